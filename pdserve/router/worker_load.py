"""One worker's load as this router sees it, and the figures the routing policy reads of it.

:class:`WorkerLoad` is a base of :class:`~pdserve.router.worker_client.WorkerClient`: it owns the
load fields and their arithmetic; the client owns the GetStats poll that feeds them.

Load of other router replicas: every GetStats answer is kept with this router's own load at
the time of the poll; :attr:`WorkerLoad.other_tokens` / :attr:`other_prompt_tokens` are the
worker's figure minus that own share (never below 0), stale by at most STATS_INTERVAL_S plus a
round trip. This router's own load is counted live (``add_load``).
"""
from __future__ import annotations

import time

from pdserve.common.worker_types import WorkerInfo, WorkerStats
from pdserve.router.pd_policy import decayed_rate
from pdserve.router.settings import RouterSettings


class WorkerLoad:
    """The load fields of a worker client; the client sets ``settings``, ``info`` (its block
    size) and ``stats`` (its last GetStats)."""

    settings: RouterSettings
    info: WorkerInfo | None
    stats: WorkerStats | None

    def __init__(self) -> None:
        # Load from this router, live.
        self.inflight = 0
        self.inflight_tokens = 0        # decode: prompt + tokens generated so far
        self.inflight_prompt_tokens = 0 # prefill: prompts being prefilled
        self.decoding = 0               # requests this router has decoding here (or about to)
        # Other routers' load, from the last GetStats (see the module docstring).
        self.other_tokens = 0
        self.other_prompt_tokens = 0
        # What the routing policy reads per worker per request, kept current where it changes
        # (add_load, each GetStats; sync_figures after setting the fields above directly).
        self.load_tokens = 0            # inflight_tokens + other_tokens
        self.queued_prompt_tokens = 0   # inflight_prompt_tokens + other_prompt_tokens
        self.free_blocks = 0            # last GetStats: num_total_blocks - num_used_blocks (0: none)
        self.total_blocks = 0           # last GetStats: num_total_blocks (0: unknown)
        self.prefill_tokens_per_s = 0.0 # last GetStats (0: unmeasured)
        # Prompt tokens this router sent here to compute, as a decayed counter (pdserve.router.pd_policy's
        # W is its value now): its value when last updated, and when (time.monotonic()).
        self.prefill_counter = 0.0
        self.prefill_counter_at = 0.0

    def _note_others(self, stats: WorkerStats, own_tokens: int, own_prompt: int) -> None:
        """Other routers' load = the worker's figure minus this router's share at the poll."""
        bs = self.info.block_size if self.info is not None else 0
        held = max(stats.num_running_context_tokens + stats.num_waiting_prefill_tokens,
                   stats.num_used_blocks * bs)
        self.other_tokens = max(0, held - own_tokens)
        self.other_prompt_tokens = max(0, stats.num_waiting_prefill_tokens - own_prompt)
        self.sync_figures()

    def sync_figures(self) -> None:
        """Recompute the policy's figures (``load_tokens`` ...) from the load fields and ``stats``."""
        s = self.stats
        self.load_tokens = self.inflight_tokens + self.other_tokens
        self.queued_prompt_tokens = self.inflight_prompt_tokens + self.other_prompt_tokens
        self.free_blocks = s.num_total_blocks - s.num_used_blocks if s is not None else 0
        self.total_blocks = s.num_total_blocks if s is not None else 0
        self.prefill_tokens_per_s = s.prefill_tokens_per_s if s is not None else 0.0

    def add_load(self, requests: int = 0, tokens: int = 0, prompt_tokens: int = 0, computed: int = 0,
                 decoding: int = 0) -> None:
        """``computed``: prompt tokens this router just gave the worker to compute (its prefill rate);
        ``decoding``: requests that now decode here (+1) or stopped (-1)."""
        self.inflight += requests
        self.decoding += decoding
        self.inflight_tokens += tokens
        self.inflight_prompt_tokens += prompt_tokens
        self.load_tokens += tokens
        self.queued_prompt_tokens += prompt_tokens
        if computed:
            now, window = time.monotonic(), self.settings.pd.rate_window_s
            decayed = decayed_rate(self.prefill_counter, self.prefill_counter_at, now, window)
            self.prefill_counter = decayed + computed
            self.prefill_counter_at = now

    def prefill_rate(self) -> float:
        """Prompt tokens per second this router has had the worker compute lately: an
        exponentially decayed counter over ``rate_window_s`` (pdserve.router.pd_policy's lam)."""
        window = self.settings.pd.rate_window_s
        return decayed_rate(self.prefill_counter, self.prefill_counter_at, time.monotonic(), window) / window
