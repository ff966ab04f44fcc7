"""Where a request goes: pure functions over snapshots of the workers (unit-testable).

Decode worker (role decode or both), ``mode="kv"`` (the default)::

    score(w) = matched_tokens(w) - alpha * pressure * excess_tokens(w)
    excess_tokens(w) = max(0, load_tokens(w) - mean_load)
    load_tokens(w) = inflight_tokens(w) + other_tokens(w)
    mean_load = mean(load_tokens over the candidates that fit)
    pressure = min(1, mean_load / (LOADED_POOL_FRACTION * block_size * min(num_total_blocks)))

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
  conversation's previous turns also runs them (multi-turn chat: the next turn often arrives
  while earlier ones still decode), so its load exceeds its cache advantage over an idle peer;
  charged from 0, load would send every next turn away from its KV;
- ``pressure``: how loaded the fleet is, from 0 (idle) to 1 (the mean load reaches
  ``LOADED_POOL_FRACTION``, a quarter, of the smallest KV pool among the candidates that fit;
  1 when a pool size is unknown, ``num_total_blocks`` 0). A lightly loaded fleet is not
  balanced at the cost of its caches: with fewer requests than workers the mean is a fraction
  of one request, while a conversation's worker runs several of its turns at once and sits far
  above it with a nearly empty pool. Excess load there costs little (a decode step barely grows
  with it), a lost prefix costs its whole prompt again; so the load term fades in with the
  fleet's load. In a saturated fleet (pressure 1) a worker keeps its prefixes until it carries
  more than ``matched / alpha`` tokens above the average ("unless it is really overloaded"),
  which holds the balance (max/mean of tokens in flight) there;
- ``alpha`` (``--load-alpha``, default 1.0): at pressure 1, one token of load above the mean
  costs as much as one cached prompt token saves. 0 = pure cache affinity; large =
  least-loaded among the workers above the mean.

The highest score wins; a worker whose last stats show too few allocatable blocks for the
request (``num_total_blocks - num_used_blocks`` < blocks still needed) is only chosen when no
worker fits. Ties (e.g. a prompt no worker holds: every worker at or below the mean scores 0)
go to the lower ``load_tokens``, then fewer requests in flight, then round-robin: the first tied
worker at or after the ``turn``-th of all candidates in key order (so equal workers share the
load even when the worker chosen last still looks busier for a moment).

Prefill worker (role prefill), ``mode="kv"``::

    cost(w) = (prompt_tokens - matched_tokens(w)) + inflight_prompt_tokens(w) + other_prompt_tokens(w)

the prompt tokens it must still compute for this request plus those queued there: this
router's prompts in flight (live) and the other replicas' (the worker's
``num_waiting_prefill_tokens`` minus this router's in-flight prompt tokens at that poll, >= 0).
The lowest cost wins; ties go to fewer requests in flight, then round-robin.

Baselines (``--routing``): ``least-loaded`` ranks by load alone (decode: lowest
``load_tokens`` among the workers that fit; prefill: lowest queued prompt tokens), ignoring
cached prefixes; ``round-robin`` takes the ``turn``-th worker in key order, ignoring both.

Cost: a decode pick (``pick_decode_workers``, over the router's workers as they are: their
``load_tokens`` / ``free_blocks`` / ``total_blocks`` are kept current by the worker client, and
the prefix match is a dict read by key) makes no object per worker, reads each worker's fields
in a few list comprehensions (fit, loads, matched blocks) and scores no worker one by one in
the usual case: no score exceeds
``max(matched) * block_size``, and a worker holding the longest prefix at or below the mean
reaches it, so the winner is the least-loaded such worker. Only when every holder of the longest
prefix is above the mean are all candidates scored (``decode_score``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

ROUTING_MODES = ("kv", "least-loaded", "round-robin")
LOADED_POOL_FRACTION = 0.25  # decode: a mean load of this share of the smallest KV pool is pressure 1


@dataclass(slots=True)
class DecodeCandidate:
    key: str
    matched_blocks: int = 0
    inflight_tokens: int = 0          # this router's requests: prompt + generated so far
    inflight_requests: int = 0
    used_blocks: int = 0              # last GetStats
    total_blocks: int = 0             # last GetStats (0 = unknown)
    other_tokens: int = 0             # other routers' requests, from the last GetStats

    # the DecodeWorker view
    @property
    def load_tokens(self) -> int:
        return self.inflight_tokens + self.other_tokens

    @property
    def inflight(self) -> int:
        return self.inflight_requests

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks


class DecodeWorker(Protocol):
    """What the decode pick reads of a worker (``WorkerClient`` keeps these current;
    ``DecodeCandidate`` derives them from its fields)."""

    @property
    def key(self) -> str: ...
    @property
    def load_tokens(self) -> int: ...        # inflight_tokens + other_tokens
    @property
    def inflight(self) -> int: ...           # this router's requests in flight there
    @property
    def free_blocks(self) -> int: ...        # total_blocks - used_blocks (last GetStats)
    @property
    def total_blocks(self) -> int: ...       # 0 = unknown


W = TypeVar("W", bound=DecodeWorker)


@dataclass(slots=True)
class PrefillCandidate:
    key: str
    matched_blocks: int = 0
    inflight_prompt_tokens: int = 0
    inflight_requests: int = 0
    other_prompt_tokens: int = 0      # other routers' queued prompt tokens, from the last GetStats


def decode_load_tokens(c: DecodeCandidate, block_size: int = 0) -> int:
    return c.inflight_tokens + c.other_tokens


def decode_score(c: DecodeCandidate, block_size: int, alpha: float, mean_load: float = 0.0,
                 pressure: float = 1.0) -> float:
    """matched_tokens - alpha * pressure * max(0, load_tokens - mean_load) (see the module
    docstring)."""
    excess = c.inflight_tokens + c.other_tokens - mean_load
    return c.matched_blocks * block_size - (alpha * pressure * excess if excess > 0 else 0.0)


def fleet_pressure(candidates: Sequence[DecodeWorker], block_size: int, mean_load: float) -> float:
    """min(1, mean_load / (LOADED_POOL_FRACTION of the smallest KV pool among ``candidates``));
    1 when a pool is unknown."""
    pools = [c.total_blocks for c in candidates]
    loaded = LOADED_POOL_FRACTION * block_size * min(pools) if pools else 0.0
    return min(1.0, mean_load / loaded) if loaded > 0 else 1.0


def _round_robin(keys: list[str], turn: int, pool: Sequence[str] = ()) -> str:
    """The ``turn``-th of ``keys`` in key order. With ``pool`` (the keys of every candidate):
    the first of ``keys`` at or after the ``turn``-th of the pool, wrapping, so that the turn
    walks over the whole pool even when which workers tie changes from one request to the next."""
    keys.sort()
    if not pool:
        return keys[turn % len(keys)]
    ordered = sorted(pool)
    start = ordered[turn % len(ordered)]
    return next((k for k in keys if k >= start), keys[0])


def _best(scored: list[tuple[float, int, int, str]], turn: int) -> str:
    """Highest score, then lowest load, then fewest requests in flight, then round-robin over
    what is left. ``scored``: (score, -load, -requests, key)."""
    top = max(scored)[:3]
    ties = [k for s, neg_load, neg_n, k in scored if (s, neg_load, neg_n) == top]
    return ties[0] if len(ties) == 1 else _round_robin(ties, turn)


def pick_decode(candidates: Sequence[DecodeCandidate], prompt_tokens: int, block_size: int,
                alpha: float = 1.0, turn: int = 0, mode: str = "kv") -> str | None:
    """The key of the decode worker for a request, or None when there is no candidate
    (``pick_decode_workers`` over snapshots)."""
    matched = {c.key: c.matched_blocks for c in candidates if c.matched_blocks}
    return pick_decode_workers(candidates, matched, prompt_tokens, block_size, alpha, turn, mode)


def pick_decode_workers(workers: Sequence[W], matched: Mapping[str, int], prompt_tokens: int, block_size: int,
                        alpha: float = 1.0, turn: int = 0, mode: str = "kv") -> str | None:
    """The key of the decode worker for a request, or None when there is no worker.
    ``matched``: worker key -> leading blocks of the prompt it holds (absent: none). See "Cost"
    in the module docstring for how the highest score is found without scoring each."""
    if not workers:
        return None
    if mode == "round-robin":
        return _round_robin([w.key for w in workers], turn)
    need = -(-prompt_tokens // block_size) if block_size > 0 else 0
    get = matched.get
    fitting = [w for w in workers if w.total_blocks <= 0 or w.free_blocks >= need
               or w.free_blocks + get(w.key, 0) >= need] or workers
    loads = [w.load_tokens for w in fitting]
    if mode == "least-loaded":
        return _least_loaded(fitting, loads, range(len(fitting)), turn)
    mean = sum(loads) / len(loads)
    held = [get(w.key, 0) for w in fitting] if matched else [0] * len(fitting)
    longest = max(held)
    top = [i for i, m in enumerate(held) if m == longest]
    if alpha == 0 or min(map(loads.__getitem__, top)) <= mean:
        # a holder of the longest prefix has no excess: its score, longest * block_size, is the
        # highest any worker can have; only such holders reach it, and the least loaded wins.
        if block_size > 0 and alpha >= 0:
            return _least_loaded(fitting, loads, top, turn)
    weight = alpha * fleet_pressure(fitting, block_size, mean)
    best: tuple | None = None        # every worker scored: decode_score, inlined
    ties: list[str] = []
    for w, m, load in zip(fitting, held, loads):
        excess = load - mean
        rank = (m * block_size - (weight * excess if excess > 0 else 0.0), -load, -w.inflight)
        if best is None or rank > best:
            best, ties = rank, [w.key]
        elif rank == best:
            ties.append(w.key)
    return ties[0] if len(ties) == 1 else _round_robin(ties, turn, [w.key for w in fitting])


def _least_loaded(fitting: Sequence[DecodeWorker], loads: list[int], among: Sequence[int], turn: int) -> str:
    """Of ``fitting[i]`` for i in ``among``: the lowest load, then fewest requests, then round-robin."""
    low = min(map(loads.__getitem__, among))
    lightest = [i for i in among if loads[i] == low]
    if len(lightest) == 1:
        return fitting[lightest[0]].key
    fewest = min(fitting[i].inflight for i in lightest)
    return _round_robin([fitting[i].key for i in lightest if fitting[i].inflight == fewest], turn,
                        [w.key for w in fitting])


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
