"""Where a request goes: pure functions over snapshots of the workers (unit-testable).

Decode worker (role decode or both)::

    score(w) = matched_tokens(w) - alpha * load_tokens(w)

- ``matched_tokens``: prompt tokens of the request whose KV the worker already holds, from the
  prefix index (leading full blocks of the request's hash chain) times the block size;
- ``load_tokens``: the tokens the worker's running requests occupy: the larger of what this
  router has in flight there (prompt + tokens generated so far, live) and the worker's own
  figure from its last GetStats (``num_used_blocks * block_size``, which also counts other
  routers' requests but lags by up to the poll interval);
- ``alpha`` (``--load-alpha``, default 1.0): one token of load costs as much as one cached
  prompt token saves. 0 = pure cache affinity; large = pure least-loaded.

The highest score wins; a worker whose last stats show too few allocatable blocks for the
request (``num_total_blocks - num_used_blocks`` < blocks still needed) is only chosen when no
worker fits. Ties go to fewer requests in flight, then round-robin (``turn``) so that equal
workers share the load.

Prefill worker (role prefill)::

    cost(w) = (prompt_tokens - matched_tokens(w)) + inflight_prompt_tokens(w)

the prompt tokens it must still compute for this request plus those of the prompts this router
has in flight there (fewest in-flight prompt tokens, corrected by its own prefix cache). The
lowest cost wins; ties as above.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeCandidate:
    key: str
    matched_blocks: int = 0
    inflight_tokens: int = 0          # this router's requests: prompt + generated so far
    inflight_requests: int = 0
    used_blocks: int = 0              # last GetStats
    total_blocks: int = 0             # last GetStats (0 = unknown)


@dataclass(frozen=True)
class PrefillCandidate:
    key: str
    matched_blocks: int = 0
    inflight_prompt_tokens: int = 0
    inflight_requests: int = 0


def decode_load_tokens(c: DecodeCandidate, block_size: int) -> int:
    return max(c.inflight_tokens, c.used_blocks * block_size)


def decode_score(c: DecodeCandidate, block_size: int, alpha: float) -> float:
    return c.matched_blocks * block_size - alpha * decode_load_tokens(c, block_size)


def _fits(c: DecodeCandidate, prompt_tokens: int, block_size: int) -> bool:
    if c.total_blocks <= 0 or block_size <= 0:
        return True  # unknown: assume it fits
    needed = -(-prompt_tokens // block_size) - c.matched_blocks
    return c.total_blocks - c.used_blocks >= needed


def _rotate_pick(tied: list[str], turn: int) -> str:
    tied = sorted(tied)
    return tied[turn % len(tied)]


def pick_decode(candidates: Sequence[DecodeCandidate], prompt_tokens: int, block_size: int,
                alpha: float = 1.0, turn: int = 0) -> str | None:
    """The key of the decode worker for a request, or None when there is no candidate."""
    if not candidates:
        return None
    fitting = [c for c in candidates if _fits(c, prompt_tokens, block_size)] or list(candidates)
    best = max(decode_score(c, block_size, alpha) for c in fitting)
    top = [c for c in fitting if decode_score(c, block_size, alpha) >= best - 1e-9]
    fewest = min(c.inflight_requests for c in top)
    return _rotate_pick([c.key for c in top if c.inflight_requests == fewest], turn)


def prefill_cost(c: PrefillCandidate, prompt_tokens: int, block_size: int) -> int:
    matched = min(c.matched_blocks * block_size, prompt_tokens)
    return prompt_tokens - matched + c.inflight_prompt_tokens


def pick_prefill(candidates: Sequence[PrefillCandidate], prompt_tokens: int, block_size: int,
                 turn: int = 0) -> str | None:
    """The key of the prefill worker for a request, or None when there is no candidate."""
    if not candidates:
        return None
    best = min(prefill_cost(c, prompt_tokens, block_size) for c in candidates)
    top = [c for c in candidates if prefill_cost(c, prompt_tokens, block_size) == best]
    fewest = min(c.inflight_requests for c in top)
    return _rotate_pick([c.key for c in top if c.inflight_requests == fewest], turn)
