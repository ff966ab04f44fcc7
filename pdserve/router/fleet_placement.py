"""``--pd-policy fleet``: the decode worker and the prefill worker chosen at once by
pdserve.router.fleet_policy from the current figures of every worker (this module turns the
router's worker clients into its snapshots), and decodes that move (pdserve/router/mover.py)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pdserve.common.worker_types import Role
from pdserve.router import fleet_policy
from pdserve.router.pd_policy import decayed_rate, uncached_tokens
from pdserve.router.slo import tighten

if TYPE_CHECKING:
    from pdserve.router.job import Job
    from pdserve.router.placement_policies import Choice, PlacementContext
    from pdserve.router.worker_client import WorkerClient


class FleetPlacement:
    """Both workers at once, from co-location's decode pick (a PlacementPolicy)."""

    moves_decodes = True

    def __init__(self, name: str) -> None:
        self.name = name

    def choose(self, placement: PlacementContext, job: Job, decoders: list[WorkerClient], excluded: set[str],
               turn: int) -> Choice:
        home = placement.choose_decode(job, decoders, turn).key
        clients = {c.key: c for c in decoders}
        clients.update((c.key, c) for c in placement.registry.prefill_workers(excluded))
        settings, bs = placement.settings, placement.registry.block_size
        n, cfg = len(job.prompt.token_ids), tighten(settings.pd, job.slo)
        matches = job.match(placement.registry.prefix_index, bs) if len(clients) > 1 else {}
        now = time.monotonic()
        snaps = [fleet_worker(c, uncached_tokens(n, matches.get(c.key, 0), bs), now, cfg.rate_window_s)
                 for c in clients.values()]
        d_key, decision = fleet_policy.decide(snaps, cfg, home)
        prefill = clients[decision.prefill_key] if decision.prefill_key else None
        return clients[d_key], prefill, decision


def fleet_workers(placement: PlacementContext) -> list[fleet_policy.FleetWorker]:
    """Every usable worker as the fleet policy reads it, without a request (``U`` = 0): the
    mover's view."""
    clients = {c.key: c for c in placement.registry.decode_workers()}
    clients.update((c.key, c) for c in placement.registry.prefill_workers())
    now, window = time.monotonic(), placement.settings.pd.rate_window_s
    return [fleet_worker(c, 0, now, window) for c in clients.values()]


def fleet_worker(c: WorkerClient, uncached: int, now: float, window_s: float) -> fleet_policy.FleetWorker:
    """A worker as the fleet policy reads it: this router's live figures and its last GetStats."""
    s = c.stats
    return fleet_policy.FleetWorker(
        c.key, uncached, c.queued_prompt_tokens, c.prefill_tokens_per_s, c.decoding,
        s.decode_step_ms if s else 0.0, s.ms_per_prompt_token if s else 0.0, s.max_num_batched_tokens if s else 0,
        decayed_rate(c.prefill_counter, c.prefill_counter_at, now, window_s),
        c.can_decode, c.role is not Role.DECODE, s.tpot_target_ms > 0 if s else True)
