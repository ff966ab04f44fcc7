"""Where a request runs: its decode worker and where it is prefilled, from the registry's workers
as they are now, by the placement policy named by ``--pd-policy`` (pdserve/router/placement_policies.py).
The decisions are pure functions elsewhere (pdserve.router.policy for the decode worker,
pdserve.router.pd_policy for local or remote prefill, pdserve.router.fleet_policy for both at
once); this module and the policies turn the workers into their snapshots.

Raises Unavailable when no decode worker is up.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace

from pdserve.common.grpc_utils import Unavailable
from pdserve.common.worker_types import Role
from pdserve.router import placement_policies
from pdserve.router.job import Job
from pdserve.router.pd_policy import (
    REMOTE,
    DecodePlace,
    PdDecision,
    PrefillPlace,
    decide_workers,
    uncached_tokens,
)
from pdserve.router.policy import PrefillCandidate, pick_decode_workers, pick_prefill
from pdserve.router.settings import RouterSettings
from pdserve.router.slo import tighten
from pdserve.router.worker_client import WorkerClient
from pdserve.router.workers import WorkerRegistry


class Placement:
    """Chooses the workers of each try of a request (``choose``)."""

    def __init__(self, registry: WorkerRegistry, settings: RouterSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.policy = placement_policies.create(settings.pd.mode)
        self._turn = itertools.count()

    def choose(self, job: Job, excluded: set[str], forced: tuple[str, str] | None = None
               ) -> tuple[WorkerClient, WorkerClient | None, PdDecision]:
        """The decode worker (pdserve.router.policy), then where to prefill (pdserve.router.pd_policy);
        ``forced``: (decode worker, prefill worker) of a decode move, taken while both are usable."""
        if forced is not None and (moved := self._forced(job, *forced)) is not None:
            return moved
        decoders = self.registry.decode_workers(excluded)
        if not decoders:
            known = [c for c in self.registry.clients.values() if c.can_decode or not c.info]
            why = "; ".join(f"{c.key}: {c.last_error or 'down'}" for c in known[:4])
            raise Unavailable("no decode worker is up" + (f" ({why})" if why else ""))
        turn = next(self._turn)     # one per request: round-robin covers every worker of each pool
        return self.policy.choose(self, job, decoders, excluded, turn)

    def _forced(self, job: Job, decode_key: str, prefill_key: str
                ) -> tuple[WorkerClient, WorkerClient | None, PdDecision] | None:
        """A move's placement (reason ``move``): None when either worker is not usable now."""
        decode, prefill = self.registry.clients.get(decode_key), self.registry.clients.get(prefill_key)
        if decode is None or prefill is None or not (decode.usable and decode.can_decode and prefill.usable):
            return None
        if prefill.role is Role.DECODE:
            return None
        bs, n = self.registry.block_size, len(job.prompt.token_ids)
        matches = job.match(self.registry.prefix_index, bs)
        return decode, prefill, PdDecision(REMOTE, prefill_key, "move", 0.0, 0.0,
                                           uncached_tokens(n, matches.get(prefill_key, 0), bs))

    def choose_decode(self, job: Job, decoders: list[WorkerClient], turn: int) -> WorkerClient:
        """pdserve.router.policy over the decode workers' current figures. The prompt's block hashes
        only matter when there is a choice: one decode worker is picked without them."""
        if len(decoders) == 1:
            return decoders[0]
        bs = self.registry.block_size
        matched = job.match(self.registry.prefix_index, bs)
        key = pick_decode_workers(decoders, matched, len(job.prompt.token_ids), bs, self.settings.load_alpha, turn,
                                  self.settings.routing)
        if key is None:     # only without candidates, which _choose rules out
            raise Unavailable("no decode worker is up")
        return self.registry.clients[key]

    def place_prefill(self, job: Job, decode: WorkerClient, prefillers: list[WorkerClient],
                      turn: int) -> PdDecision:
        """Local or remote (pdserve.router.pd_policy), from the current figures of the decode worker
        and the prefill-capable workers; the ``--routing`` baselines keep their own choice of the
        prefill worker."""
        cfg, bs, n = tighten(self.settings.pd, job.slo), self.registry.block_size, len(job.prompt.token_ids)
        index = self.registry.prefix_index
        hashed = (index is not None and cfg.mode != "never"
                  and (decode.kv_wanted or any(c.kv_wanted for c in prefillers)))
        matches = job.match(index, bs) if hashed else {}

        s = decode.stats
        own = PrefillPlace(decode.key, uncached_tokens(n, matches.get(decode.key, 0), bs),
                           decode.queued_prompt_tokens, decode.prefill_tokens_per_s)
        d = DecodePlace(own, decode.role is Role.BOTH, s.decode_step_ms if s else 0.0,
                        s.mixed_step_ms if s else 0.0, s.max_num_batched_tokens if s else 0,
                        s.chunked_prefill if s else True, decode.prefill_rate())
        decision = decide_workers(d, prefillers if cfg.mode != "never" else [], matches, n, bs, cfg,
                                  self.settings.load_alpha, time.monotonic())
        if decision.kind == REMOTE and self.settings.routing != "kv" and len(prefillers) > 1:
            pc = [PrefillCandidate(c.key, 0, c.inflight_prompt_tokens, c.inflight, c.other_prompt_tokens)
                  for c in prefillers]
            key = pick_prefill(pc, n, bs, turn, self.settings.routing)
            if key is not None:     # None only without candidates
                decision = replace(decision, prefill_key=key,
                                   prefill_tokens=uncached_tokens(n, matches.get(key, 0), bs))
        return decision
