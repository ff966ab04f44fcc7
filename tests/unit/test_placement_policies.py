"""Placement policies by name (pdserve/router/placement_policies.py): the built-in ones, one added
without editing the package (a ``module:Class`` name, or ``register``), and unknown names refused
by the router's flag with the names it knows."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from pdserve.router import placement_policies
from pdserve.router.fleet_placement import FleetPlacement
from pdserve.router.main import add_arguments
from pdserve.router.split_placement import SplitPlacement

PLUGINS = Path(__file__).parents[1] / "plugins"     # toy_placement.py


def test_built_in_policies_are_imported_by_name():
    for name in ("adaptive", "always", "never"):
        p = placement_policies.create(name)
        assert isinstance(p, SplitPlacement) and p.name == name and not p.moves_decodes
    fleet = placement_policies.create("fleet")
    assert isinstance(fleet, FleetPlacement) and fleet.moves_decodes
    assert set(placement_policies.names()) >= {"adaptive", "always", "never", "fleet"}


def test_a_policy_from_its_own_module(monkeypatch):
    monkeypatch.syspath_prepend(str(PLUGINS))
    p = placement_policies.create("toy_placement:LastWorker")
    assert type(p).__name__ == "LastWorker" and p.name == "toy_placement:LastWorker"
    sys.modules.pop("toy_placement", None)


def test_a_registered_policy_and_unknown_names():
    placement_policies.register("toy", lambda name: SplitPlacement("never"))
    try:
        assert placement_policies.check_name("toy") == "toy"
        assert isinstance(placement_policies.create("toy"), SplitPlacement)
    finally:
        placement_policies._registered.pop("toy")
    with pytest.raises(ValueError, match="built in"):
        placement_policies.register("fleet", FleetPlacement)
    with pytest.raises(ValueError, match="unknown placement policy 'sometimes'"):
        placement_policies.check_name("sometimes")
    with pytest.raises(ValueError, match="cannot import no_such_module:Policy"):
        placement_policies.create("no_such_module:Policy")


def test_the_router_flag_names_the_known_policies(capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--pd-policy", "sometimes"])
    assert "unknown placement policy 'sometimes': one of adaptive, always, never, fleet" in capsys.readouterr().err
