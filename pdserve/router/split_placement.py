"""``--pd-policy adaptive | always | never``: the decode worker first (pdserve.router.policy: cached
prefix and load), then where it is prefilled (pdserve.router.pd_policy: locally, or on a prefill
worker); ``always`` is the static disaggregated split, ``never`` co-location."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.router.job import Job
    from pdserve.router.placement_policies import Choice, PlacementContext
    from pdserve.router.worker_client import WorkerClient


class SplitPlacement:
    """The decode pick, then the prefill place (a PlacementPolicy)."""

    moves_decodes = False

    def __init__(self, name: str) -> None:
        self.name = name

    def choose(self, placement: PlacementContext, job: Job, decoders: list[WorkerClient], excluded: set[str],
               turn: int) -> Choice:
        decode = placement.choose_decode(job, decoders, turn)
        prefillers = [c for c in placement.registry.prefill_workers(excluded) if c is not decode]
        decision = placement.place_prefill(job, decode, prefillers, turn)
        prefill = placement.registry.clients[decision.prefill_key] if decision.prefill_key else None
        return decode, prefill, decision
