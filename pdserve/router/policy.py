"""Where a request goes: pure functions over snapshots of the workers (unit-testable).

Decode worker (role decode or both), ``mode="kv"`` (the default)::

    score(w) = matched_tokens(w) - alpha * excess_tokens(w)
    excess_tokens(w) = max(0, load_tokens(w) - mean(load_tokens over the candidates that fit))
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
- ``excess_tokens``: load is only a cost above the fleet's mean. A worker that holds a
  conversation's previous turn also runs it (multi-turn chat: the next turn often arrives while
  the previous one decodes), so its load always exceeds its cache advantage over an idle peer;
  charged from 0, load would send every next turn away from its KV. Charged above the mean, a
  worker keeps its prefixes until it carries more than ``matched / alpha`` tokens above the
  average: "unless it is really overloaded";
- ``alpha`` (``--load-alpha``, default 1.0): one token of load above the mean costs as much as
  one cached prompt token saves. 0 = pure cache affinity; large = least-loaded among the
  workers above the mean.

The highest score wins; a worker whose last stats show too few allocatable blocks for the
request (``num_total_blocks - num_used_blocks`` < blocks still needed) is only chosen when no
worker fits. Ties (e.g. a prompt no worker holds: every worker at or below the mean scores 0)
go to the lower ``load_tokens``, then fewer requests in flight, then round-robin (``turn``) so
that equal workers share the load.

Prefill worker (role prefill), ``mode="kv"``::

    cost(w) = (prompt_tokens - matched_tokens(w)) + inflight_prompt_tokens(w) + other_prompt_tokens(w)

the prompt tokens it must still compute for this request plus those queued there: this
router's prompts in flight (live) and the other replicas' (the worker's
``num_waiting_prefill_tokens`` minus this router's in-flight prompt tokens at that poll, >= 0).
The lowest cost wins; ties go to fewer requests in flight, then round-robin.

Baselines (``--routing``): ``least-loaded`` ranks by load alone (decode: lowest
``load_tokens`` among the workers that fit; prefill: lowest queued prompt tokens), ignoring
cached prefixes; ``round-robin`` takes the ``turn``-th worker in key order, ignoring both.
Every pick is two passes over the candidates (the mean, then the scores): O(workers).
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


def decode_load_tokens(c: DecodeCandidate, block_size: int = 0) -> int:
    return c.inflight_tokens + c.other_tokens


def decode_score(c: DecodeCandidate, block_size: int, alpha: float, mean_load: float = 0.0) -> float:
    """matched_tokens - alpha * max(0, load_tokens - mean_load) (see the module docstring)."""
    excess = c.inflight_tokens + c.other_tokens - mean_load
    return c.matched_blocks * block_size - (alpha * excess if excess > 0 else 0.0)


def _round_robin(keys: list[str], turn: int) -> str:
    keys.sort()
    return keys[turn % len(keys)]


def _best(scored: list[tuple[float, int, int, str]], turn: int) -> str:
    """Highest score, then lowest load, then fewest requests in flight, then round-robin over
    what is left. ``scored``: (score, -load, -requests, key)."""
    top = max(scored)[:3]
    ties = [k for s, neg_load, neg_n, k in scored if (s, neg_load, neg_n) == top]
    return ties[0] if len(ties) == 1 else _round_robin(ties, turn)


def pick_decode(candidates: Sequence[DecodeCandidate], prompt_tokens: int, block_size: int,
                alpha: float = 1.0, turn: int = 0, mode: str = "kv") -> str | None:
    """The key of the decode worker for a request, or None when there is no candidate.

    One pass for the fit (unknown pool sizes fit) and the loads, one for the scores
    (``decode_score`` inlined: this runs for every worker on every request)."""
    if not candidates:
        return None
    if mode == "round-robin":
        return _round_robin([c.key for c in candidates], turn)
    need = -(-prompt_tokens // block_size) if block_size > 0 else 0
    fitting = [c for c in candidates
               if c.total_blocks <= 0 or c.total_blocks - c.used_blocks + c.matched_blocks >= need] or candidates
    loads = [c.inflight_tokens + c.other_tokens for c in fitting]
    kv = mode != "least-loaded"
    mean = sum(loads) / len(loads)
    best: tuple | None = None
    ties: list[str] = []
    for c, load in zip(fitting, loads):
        if kv:
            excess = load - mean
            score = c.matched_blocks * block_size - (alpha * excess if excess > 0 else 0.0)
        else:
            score = 0.0
        rank = (score, -load, -c.inflight_requests)
        if best is None or rank > best:
            best, ties = rank, [c.key]
        elif rank == best:
            ties.append(c.key)
    return ties[0] if len(ties) == 1 else _round_robin(ties, turn)


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
        scored = [(-float(c.inflight_prompt_tokens + c.other_prompt_tokens), 0, -c.inflight_requests, c.key)
                  for c in candidates]
    else:
        scored = [(-float(prefill_cost(c, prompt_tokens, block_size)), 0, -c.inflight_requests, c.key)
                  for c in candidates]
    return _best(scored, turn)
