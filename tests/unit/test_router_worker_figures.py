"""The routing policy over the worker clients' kept figures (``pick_decode_workers``,
``decide_workers``) against the definitions over snapshots built from the raw fields, on random
fleets: each ``WorkerClient``'s load and stats go through the real update paths (a GetStats
answer, then requests starting and ending), and the decisions must be exactly the same."""
from __future__ import annotations

import asyncio
import functools
import random

import pytest

from pdserve.common.worker_types import Role, WorkerInfo, WorkerStats
from pdserve.router.pd_policy import DecodePlace, PdConfig, PrefillPlace, decide, decide_workers, uncached_tokens
from pdserve.router.policy import DecodeCandidate, decode_score, fleet_pressure, pick_decode_workers
from pdserve.router.settings import RouterSettings
from pdserve.router.tokenization import ModelSpec
from pdserve.router.worker_client import WorkerClient
from pdserve.router.workers import DECODE_ROLES, WorkerRegistry

BS = 4


def _worker(registry: WorkerRegistry, key: str, rng: random.Random) -> WorkerClient:
    c = WorkerClient(key, DECODE_ROLES, registry.settings, registry.prefix_index, registry._check_info)
    registry.clients[key] = c
    c.info = WorkerInfo(role=Role.BOTH, block_size=BS, num_kv_blocks=256, worker_id=key)
    own_tokens, own_prompt = rng.choice([0, 40, 300]), rng.choice([0, 0, 64])
    c.add_load(requests=rng.randrange(0, 3), tokens=own_tokens, prompt_tokens=own_prompt)
    if rng.random() < 0.85:         # else never polled: no stats yet
        total = rng.choice([0, 64, 128, 256])
        used = rng.randrange(0, total + 1)
        c.stats = WorkerStats(num_used_blocks=used, num_total_blocks=total,
                              num_running_context_tokens=rng.choice([0, 100, 500]),
                              num_waiting_prefill_tokens=rng.choice([0, 0, 200]),
                              prefill_tokens_per_s=rng.choice([0.0, 5000.0, 20000.0]))
        c._note_others(c.stats, own_tokens, own_prompt)     # what a GetStats answer does
    for _ in range(rng.randrange(0, 4)):    # requests start and end after the poll
        tokens, prompt = rng.choice([(10, 10), (120, 0), (300, 64)])
        sign = rng.choice([1, -1]) if c.inflight_tokens >= tokens and c.inflight_prompt_tokens >= prompt else 1
        c.add_load(requests=sign, tokens=sign * tokens, prompt_tokens=sign * prompt)
    return c


def _snapshot(c: WorkerClient, matched: dict[str, int]) -> DecodeCandidate:
    """The decode snapshot as the flow built it before the kept figures."""
    s = c.stats
    return DecodeCandidate(c.key, matched.get(c.key, 0), c.inflight_tokens, c.inflight,
                           s.num_used_blocks if s is not None else 0, s.num_total_blocks if s is not None else 0,
                           c.other_tokens)


def rotate(ties: list[str], pool: list[str], turn: int) -> str:
    """The definition of the tie rule: the first tie at or after the ``turn``-th of the pool in
    key order, wrapping."""
    ordered = sorted(pool)
    after = [k for k in sorted(ties) if k >= ordered[turn % len(ordered)]]
    return (after or sorted(ties))[0]


def _definition(cands: list[DecodeCandidate], prompt: int, alpha: float, turn: int, mode: str) -> str:
    """Every fitting candidate ranked (kv: decode_score; least-loaded: load), ties round-robin over
    the fitting candidates' keys."""
    if mode == "round-robin":
        keys = sorted(c.key for c in cands)
        return keys[turn % len(keys)]
    need = -(-prompt // BS)
    fitting = [c for c in cands if c.total_blocks <= 0
               or c.total_blocks - c.used_blocks + c.matched_blocks >= need] or cands
    mean = sum(c.inflight_tokens + c.other_tokens for c in fitting) / len(fitting)
    pressure = fleet_pressure(fitting, BS, mean)

    def rank(c: DecodeCandidate) -> tuple:
        score = decode_score(c, BS, alpha, mean, pressure) if mode == "kv" else 0.0
        return score, -(c.inflight_tokens + c.other_tokens), -c.inflight_requests

    best = max(rank(c) for c in fitting)
    ties = sorted(c.key for c in fitting if rank(c) == best)
    return ties[0] if len(ties) == 1 else rotate(ties, [c.key for c in fitting], turn)


@functools.cache
def _fleets(seed: int, trials: int) -> list[tuple[WorkerRegistry, list[WorkerClient], dict[str, int], int]]:
    async def build() -> list[tuple[WorkerRegistry, list[WorkerClient], dict[str, int], int]]:
        rng = random.Random(seed)
        out = []
        for _ in range(trials):
            registry = WorkerRegistry(RouterSettings(router_id="t", block_size=BS),
                                      ModelSpec(name="m", max_model_len=4096, vocab_size=100), [], [])
            workers = [_worker(registry, f"w{i:02d}", rng) for i in range(rng.randrange(1, 20))]
            matched = {c.key: rng.choice([3, 8, 8, 20, 60]) for c in workers if rng.random() < 0.4}
            if rng.random() < 0.2:
                matched["elsewhere"] = 5    # a worker that is not a candidate (excluded, prefill-only)
            out.append((registry, workers, matched, rng.randrange(1, 300)))
        for registry, *_ in out:
            await registry.stop()
        return out
    return asyncio.run(build())


@pytest.mark.parametrize("mode,alpha", [("kv", 0.0), ("kv", 0.5), ("kv", 1.0), ("kv", 4.0),
                                        ("least-loaded", 1.0), ("round-robin", 1.0)])
def test_decode_pick_over_workers_equals_the_definition(mode: str, alpha: float) -> None:
    for turn, (_, workers, matched, prompt) in enumerate(_fleets(5, 300)):
        cands = [_snapshot(c, matched) for c in workers]
        for c, snap in zip(workers, cands):     # the kept figures are the raw fields' sums
            assert c.load_tokens == snap.inflight_tokens + snap.other_tokens
            assert (c.total_blocks, c.free_blocks) == (snap.total_blocks, snap.total_blocks - snap.used_blocks)
        want = _definition(cands, prompt, alpha, turn, mode)
        assert pick_decode_workers(workers, matched, prompt, BS, alpha, turn, mode) == want


@pytest.mark.parametrize("mode", ["adaptive", "always", "never"])
def test_prefill_decision_over_workers_equals_decide_on_places(mode: str) -> None:
    cfg = PdConfig(mode=mode, local_max_tokens=32)
    for _, workers, matched, prompt in _fleets(9, 300):
        def place(c: WorkerClient, matched: dict[str, int] = matched, prompt: int = prompt) -> PrefillPlace:
            s = c.stats                 # as the flow built it before the kept figures
            return PrefillPlace(c.key, uncached_tokens(prompt, matched.get(c.key, 0), BS),
                                c.inflight_prompt_tokens + c.other_prompt_tokens,
                                s.prefill_tokens_per_s if s is not None else 0.0)
        decode, prefillers = workers[0], workers[1:]
        for can_prefill in (True, False):
            d = DecodePlace(place(decode), can_prefill, 10.0, 0.0, 512, True, 3000.0)
            want = decide(d, [place(c) for c in prefillers] if mode != "never" else [], cfg)
            assert decide_workers(d, prefillers if mode != "never" else [], matched, prompt, BS, cfg) == want
            assert decide_workers(d, workers, matched, prompt, BS, cfg) == decide(d, [place(c) for c in workers], cfg)
