"""Where a request goes: pure functions over snapshots of the workers (unit-testable).

Decode worker (role decode or both), ``mode="kv"`` (the default)::

    score(w) = matched_tokens(w) - alpha * load_tokens(w)
    load_tokens(w) = inflight_tokens(w) + other_tokens(w)

- ``matched_tokens``: prompt tokens of the request whose KV the worker already holds, from the
  prefix index (leading full blocks of the request's hash chain) times the block size;
- ``inflight_tokens``: what this router has in flight there (prompt + tokens generated so far),
  live: a burst of this router's requests counts at once;
- ``other_tokens``: the other router replicas' share, from the worker's last GetStats:
  its context tokens (``num_running_context_tokens``, else ``num_used_blocks * block_size``)
  minus this router's ``inflight_tokens`` at the time of that poll, floored at 0; stale by at
  most one poll interval (the raw stats figure is not used as load: it lags this router's own
  requests both ways, e.g. it still shows a request that ended since the poll);
- ``alpha`` (``--load-alpha``, default 1.0): one token of load costs as much as one cached
  prompt token saves. 0 = pure cache affinity; large = pure least-loaded.

The highest score wins; a worker whose last stats show too few allocatable blocks for the
request (``num_total_blocks - num_used_blocks`` < blocks still needed) is only chosen when no
worker fits. Ties go to fewer requests in flight, then round-robin (``turn``) so that equal
workers share the load.

Prefill worker (role prefill), ``mode="kv"``::

    cost(w) = (prompt_tokens - matched_tokens(w)) + inflight_prompt_tokens(w) + other_prompt_tokens(w)

the prompt tokens it must still compute for this request plus those queued there: this
router's prompts in flight (live) and the other replicas' (the worker's
``num_waiting_prefill_tokens`` minus this router's in-flight prompt tokens at that poll, >= 0).
The lowest cost wins; ties as above.

Baselines (``--routing``): ``least-loaded`` ranks by load alone (decode: lowest
``load_tokens`` among the workers that fit; prefill: lowest queued prompt tokens), ignoring
cached prefixes; ``round-robin`` takes the ``turn``-th worker in key order, ignoring both.
Every pick is one pass over the candidates: O(workers).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_MODES = ("kv", "least-loaded", "round-robin")


@dataclass(slots=True)
class DecodeCandidate:
    key: str
    matched_blocks: int = 0
    inflight_tokens: int = 0          # this router's requests: prompt + generated so far
    inflight_requests: int = 0
    used_blocks: int = 0              # last GetStats
    total_blocks: int = 0             # last GetStats (0 = unknown)
    other_tokens: int = 0             # other routers' requests, from the last GetStats


@dataclass(slots=True)
class PrefillCandidate:
    key: str
    matched_blocks: int = 0
    inflight_prompt_tokens: int = 0
    inflight_requests: int = 0
    other_prompt_tokens: int = 0      # other routers' queued prompt tokens, from the last GetStats


def decode_load_tokens(c: DecodeCandidate, block_size: int) -> int:
    return c.inflight_tokens + c.other_tokens


def decode_score(c: DecodeCandidate, block_size: int, alpha: float) -> float:
    return c.matched_blocks * block_size - alpha * decode_load_tokens(c, block_size)


def _fits(c: DecodeCandidate, prompt_tokens: int, block_size: int) -> bool:
    if c.total_blocks <= 0 or block_size <= 0:
        return True  # unknown: assume it fits
    needed = -(-prompt_tokens // block_size) - c.matched_blocks
    return c.total_blocks - c.used_blocks >= needed


def _round_robin(keys: list[str], turn: int) -> str:
    keys.sort()
    return keys[turn % len(keys)]


def _best(scored: list[tuple[float, int, str]], turn: int) -> str:
    """Highest score, then fewest requests in flight, then round-robin over what is left."""
    best = max(s for s, _, _ in scored)
    top = [(n, k) for s, n, k in scored if s >= best - 1e-9]
    fewest = min(n for n, _ in top)
    return _round_robin([k for n, k in top if n == fewest], turn)


def pick_decode(candidates: Sequence[DecodeCandidate], prompt_tokens: int, block_size: int,
                alpha: float = 1.0, turn: int = 0, mode: str = "kv") -> str | None:
    """The key of the decode worker for a request, or None when there is no candidate."""
    if not candidates:
        return None
    if mode == "round-robin":
        return _round_robin([c.key for c in candidates], turn)
    fitting = [c for c in candidates if _fits(c, prompt_tokens, block_size)] or list(candidates)
    if mode == "least-loaded":
        scored = [(-decode_load_tokens(c, block_size), c.inflight_requests, c.key) for c in fitting]
    else:
        scored = [(decode_score(c, block_size, alpha), c.inflight_requests, c.key) for c in fitting]
    return _best(scored, turn)


def prefill_cost(c: PrefillCandidate, prompt_tokens: int, block_size: int) -> int:
    matched = min(c.matched_blocks * block_size, prompt_tokens)
    return prompt_tokens - matched + c.inflight_prompt_tokens + c.other_prompt_tokens


def pick_prefill(candidates: Sequence[PrefillCandidate], prompt_tokens: int, block_size: int,
                 turn: int = 0, mode: str = "kv") -> str | None:
    """The key of the prefill worker for a request, or None when there is no candidate."""
    if not candidates:
        return None
    if mode == "round-robin":
        return _round_robin([c.key for c in candidates], turn)
    if mode == "least-loaded":
        scored = [(-(c.inflight_prompt_tokens + c.other_prompt_tokens), c.inflight_requests, c.key)
                  for c in candidates]
    else:
        scored = [(-prefill_cost(c, prompt_tokens, block_size), c.inflight_requests, c.key)
                  for c in candidates]
    return _best(scored, turn)
