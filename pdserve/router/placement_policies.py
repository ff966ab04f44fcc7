"""Placement policies by name (``--pd-policy``): the protocol every policy meets and the registry
the router picks one from. A policy module is imported only when it is chosen.

Built in: ``adaptive``, ``always``, ``never`` (pdserve/router/split_placement.py: the decode worker
by pdserve.router.policy, then local or remote prefill by pdserve.router.pd_policy) and ``fleet``
(pdserve/router/fleet_placement.py: both at once by pdserve.router.fleet_policy, decodes that move).
A new policy is one module with a class meeting :class:`PlacementPolicy` plus one line in
BUILTIN, or, without editing the package, ``--pd-policy package.module:Class`` (the class is
imported from the router's Python path) or :func:`register` before the router starts.

Errors: an unknown name, or a ``module:Class`` that does not import, is ValueError naming it
(the router refuses to start).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdserve.router.job import Job
    from pdserve.router.pd_policy import PdDecision
    from pdserve.router.settings import RouterSettings
    from pdserve.router.worker_client import WorkerClient
    from pdserve.router.workers import WorkerRegistry

    Choice = tuple[WorkerClient, WorkerClient | None, PdDecision]


class PlacementContext(Protocol):
    """What a policy may read of the router (pdserve/router/placement.py's Placement): the workers,
    the settings, and the built-in picks it may build on."""

    registry: WorkerRegistry
    settings: RouterSettings

    def choose_decode(self, job: Job, decoders: list[WorkerClient], turn: int) -> WorkerClient:
        """Co-location's decode pick (pdserve.router.policy: cached prefix and load)."""
        ...

    def place_prefill(self, job: Job, decode: WorkerClient, prefillers: list[WorkerClient],
                      turn: int) -> PdDecision:
        """Local or remote prefill for ``decode`` (pdserve.router.pd_policy)."""
        ...


class PlacementPolicy(Protocol):
    """Where one try of a request runs.

    ``choose`` gets the router's placement context, the request, the usable decode-capable
    workers (at least one), the workers excluded for this try, and a turn number (one per
    request, for round-robin ties). It returns (decode worker, prefill worker or None for a local
    prefill, the decision for the metrics); it must not block or call a worker.
    ``moves_decodes``: whether the router runs the mover (pdserve/router/mover.py, over
    ``fleet_policy.pick_moves``) for this policy."""

    moves_decodes: bool

    def choose(self, placement: PlacementContext, job: Job, decoders: list[WorkerClient], excluded: set[str],
               turn: int) -> Choice: ...


BUILTIN: dict[str, str] = {
    "adaptive": "pdserve.router.split_placement:SplitPlacement",
    "always": "pdserve.router.split_placement:SplitPlacement",
    "never": "pdserve.router.split_placement:SplitPlacement",
    "fleet": "pdserve.router.fleet_placement:FleetPlacement",
}
_registered: dict[str, Callable[[str], PlacementPolicy]] = {}


def register(name: str, factory: Callable[[str], PlacementPolicy]) -> None:
    """Add a policy under ``name`` (``factory(name)`` builds it); a built-in name is ValueError."""
    if name in BUILTIN:
        raise ValueError(f"placement policy {name!r} is built in")
    _registered[name] = factory


def names() -> tuple[str, ...]:
    return (*BUILTIN, *_registered)


def check_name(name: str) -> str:
    """``name`` if it names a policy (built in, registered or ``module:Class``), else ValueError."""
    if name in BUILTIN or name in _registered or _dotted(name):
        return name
    raise ValueError(f"unknown placement policy {name!r}: one of {', '.join(names())}, or module:Class")


def create(name: str) -> PlacementPolicy:
    """The policy called ``name`` (module docstring); ValueError when there is none."""
    if name in _registered:
        return _registered[name](name)
    path = BUILTIN.get(name) or check_name(name)
    module, _, attr = path.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"placement policy {name!r}: cannot import {path} ({e})") from e
    return cls(name)


def _dotted(name: str) -> bool:
    module, sep, attr = name.partition(":")
    return bool(sep and module and attr.isidentifier())
