"""Each default is declared once: a service started without flags (and without PDSERVE_*
variables) runs exactly its settings dataclass's defaults, and ``pdserve up`` passes no engine
flag it was not given, so its workers take those same defaults."""
from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

from pdserve import cli
from pdserve.common.config import EngineConfig
from pdserve.common.serving.worker_args import DEFAULT_BUDGET, engine_config_from_args


@pytest.fixture(autouse=True)
def no_pdserve_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith("PDSERVE_")]:
        monkeypatch.delenv(name)


def _parse(command: str, *argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args([command, *argv])


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_a_worker_without_flags_runs_the_engine_defaults(command):
    role = "prefill" if command == "prefill" else "decode"
    config = engine_config_from_args(_parse(command), role)
    budget = DEFAULT_BUDGET[role]
    assert config == dataclasses.replace(EngineConfig(), max_num_batched_tokens=budget)
    assert DEFAULT_BUDGET["prefill"] == EngineConfig().max_num_batched_tokens     # the offline engine's


def test_a_router_without_flags_runs_the_settings_defaults():
    from pdserve.router.pd_args import pd_config_from_args
    from pdserve.router.pd_policy import PdConfig
    from pdserve.router.settings import DEFAULT_METRICS_PORT, DEFAULT_PORT, RouterSettings
    args = _parse("router")
    d = RouterSettings(router_id="")
    for name in ("block_size", "lease_ms", "worker_timeout_s", "dns_refresh_s", "load_alpha", "drain_grace_s",
                 "routing"):
        assert getattr(args, name) == getattr(d, name), name
    assert pd_config_from_args(args) == PdConfig() == d.pd
    assert (args.port, args.metrics_port) == (DEFAULT_PORT, DEFAULT_METRICS_PORT)
    assert _parse("up").router_port == DEFAULT_PORT
    assert _parse("generate", "x").router.endswith(f":{DEFAULT_PORT}")


def test_up_passes_only_the_engine_flags_it_is_given():
    from pdserve.cli import cmd_up
    workers = cmd_up.plan(_parse("up"))[:-1]
    flags = [flag for flag, _, _ in cmd_up.WORKER_FLAGS]
    for child in workers:
        assert not set(flags) & set(child.cmd), child.cmd       # the workers' own defaults
    given = cmd_up.plan(_parse("up", "--block-size", "32", "--num-kv-blocks", "64"))
    for child in given:
        assert child.cmd[child.cmd.index("--block-size") + 1] == "32"              # router and workers
    assert all(c.cmd[c.cmd.index("--num-kv-blocks") + 1] == "64" for c in given[:-1])
    assert "--num-kv-blocks" not in given[-1].cmd


@pytest.mark.parametrize("command", ["prefill", "decode"])
def test_every_flag_up_passes_through_is_a_worker_flag(command):
    from pdserve.cli import cmd_up
    parser = argparse.ArgumentParser()
    __import__(cli.SUBCOMMANDS[command][0], fromlist=["add_arguments"]).add_arguments(parser)
    options = {s for action in parser._actions for s in action.option_strings}
    assert {flag for flag, _, _ in cmd_up.WORKER_FLAGS} | {"--enforce-eager", "--model", "--device"} <= options
