"""The routing decision's fast paths, checked against their slow definitions: the bitmask prefix
match against a per-worker walk, the one-pass decode pick against decode_score, and the retry
loop's bound (a request fails over up to MAX_ATTEMPTS workers before its first token)."""
from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

import pdserve.router.flow as flow_mod
from bench.sim import decision
from pdserve.common.grpc_utils import Unavailable
from pdserve.common.hashing import block_hash_chain
from pdserve.common.outputs import SequenceOutput
from pdserve.router.attempt import Retry
from pdserve.router.policy import DecodeCandidate, decode_score, fleet_pressure, pick_decode
from pdserve.router.prefix_index import PrefixIndex, PromptHasher
from tests.unit.test_router_worker_figures import rotate

BS = 4


def _walk(index_views: dict[str, set[int]], chain: list[int]) -> dict[str, int]:
    """The definition: each worker's longest run of leading hashes of the chain."""
    out = {}
    for w, held in index_views.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        if n:
            out[w] = n
    return out


def test_bitmask_match_equals_the_per_worker_walk() -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(4, 40))] for _ in range(30)]
    chains = [block_hash_chain(p, BS) for p in prompts]
    idx, views = PrefixIndex(), {}
    for step in range(400):
        w = f"w{rng.randrange(12)}"
        chain = chains[rng.randrange(len(chains))]
        if rng.random() < 0.3 and views.get(w):              # evict a random held hash
            h = rng.choice(sorted(views[w]))
            idx.apply(w, evicted=[h])
            views[w].discard(h)
        elif rng.random() < 0.05:                             # the worker leaves; its bit is reused
            idx.remove_worker(w)
            views.pop(w, None)
        else:
            cut = rng.randrange(len(chain) + 1)
            idx.apply(w, stored=chain[:cut])
            views.setdefault(w, set()).update(chain[:cut])
        probe = chains[step % len(chains)]
        assert idx.match(probe) == _walk(views, probe)
        some = {f"w{i}" for i in range(0, 12, 3)}
        assert idx.match(probe, some) == {k: v for k, v in _walk(views, probe).items() if k in some}


def test_pick_decode_is_the_highest_decode_score() -> None:
    rng = random.Random(3)
    for _ in range(200):
        cands = [DecodeCandidate(f"w{i}", matched_blocks=rng.randrange(0, 30), inflight_tokens=rng.randrange(0, 300),
                                 inflight_requests=rng.randrange(0, 4), other_tokens=rng.randrange(0, 100))
                 for i in range(rng.randrange(1, 20))]
        mean = sum(c.inflight_tokens + c.other_tokens for c in cands) / len(cands)
        best = max(decode_score(c, BS, 1.0, mean) for c in cands)
        got = next(c for c in cands if c.key == pick_decode(cands, 8, BS))
        assert decode_score(got, BS, 1.0, mean) == best


def _rank(c: DecodeCandidate, alpha: float, mean: float, pressure: float) -> tuple:
    return (decode_score(c, BS, alpha, mean, pressure), -(c.inflight_tokens + c.other_tokens), -c.inflight_requests)


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 4.0])
def test_pick_decode_fast_path_equals_the_definition(alpha: float) -> None:
    """The pick (which scores no worker one by one when a holder of the longest prefix is at or
    below the mean) against the definition: every fitting candidate scored, its best rank,
    ties round-robin over the fitting keys. Pools differ, some workers do not fit, loads straddle
    the free band (1/8 of the smallest pool: 64 * 4 / 8 = 32 tokens and up)."""
    rng = random.Random(5)
    for trial in range(400):
        n = rng.randrange(1, 24)
        cands = []
        for i in range(n):
            total = rng.choice([0, 64, 128, 256])
            cands.append(DecodeCandidate(f"w{i:02d}", matched_blocks=rng.choice([0, 0, 3, 8, 8, 20]),
                                         inflight_tokens=rng.choice([0, 10, 40, 40, 300]),
                                         inflight_requests=rng.randrange(0, 3),
                                         used_blocks=rng.randrange(0, total + 1), total_blocks=total,
                                         other_tokens=rng.choice([0, 0, 25])))
        prompt = rng.randrange(1, 200)
        need = -(-prompt // BS)
        fitting = [c for c in cands if c.total_blocks <= 0
                   or c.total_blocks - c.used_blocks + c.matched_blocks >= need] or cands
        mean = sum(c.inflight_tokens + c.other_tokens for c in fitting) / len(fitting)
        pressure = fleet_pressure(fitting, BS, mean)
        best = max(_rank(c, alpha, mean, pressure) for c in fitting)
        ties = sorted(c.key for c in fitting if _rank(c, alpha, mean, pressure) == best)
        want = ties[0] if len(ties) == 1 else rotate(ties, [c.key for c in fitting], trial)
        assert pick_decode(cands, prompt, BS, alpha, turn=trial) == want


class _Metrics:
    def __init__(self) -> None:
        self.retries = SimpleNamespace(n=0)
        self.retries.inc = lambda: setattr(self.retries, "n", self.retries.n + 1)
        self.decision = SimpleNamespace(observe=lambda s: None)
        self.pd = SimpleNamespace(decided=lambda *a: None)


def _flow_with_failing_tries(monkeypatch, failures: int):
    """A Flow over 8 decode + 2 prefill registered workers whose first ``failures`` tries fail
    before their first token (as a killed worker's Reserve does)."""
    tried: list[str] = []

    class FailingAttempt:
        def __init__(self, flow, job, decode, prefill, rid, decision) -> None:
            self.decode = decode
            tried.append(decode.key)

        async def start(self) -> None:
            if len(tried) <= failures:
                raise Retry(Unavailable(f"try {len(tried)} failed"), self.decode.key)

        async def next(self) -> SequenceOutput:
            return SequenceOutput(token_ids=[1])

        def close(self, cancel_workers: bool) -> None:
            pass

    monkeypatch.setattr(flow_mod, "Attempt", FailingAttempt)
    cfg = decision.DecisionBenchConfig(requests=100)
    prompts = decision._prompts(cfg, random.Random(0), "shared-prefix")[:1]
    return prompts[0], tried, cfg


@pytest.mark.parametrize("failures", [0, flow_mod.MAX_ATTEMPTS - 1, flow_mod.MAX_ATTEMPTS])
def test_a_request_fails_over_up_to_max_attempts_workers(monkeypatch, failures: int) -> None:
    prompt, tried, cfg = _flow_with_failing_tries(monkeypatch, failures)

    async def scenario() -> None:
        flow, registry = decision.build(cfg, 8, [prompt])
        flow.metrics = _Metrics()
        job = decision._job(prompt)
        try:
            if failures < flow_mod.MAX_ATTEMPTS:
                att, step = await flow._start(job)
                assert step.token_ids == [1]
                assert len(tried) == failures + 1
            else:
                with pytest.raises(Unavailable, match=f"try {flow_mod.MAX_ATTEMPTS} failed"):
                    await flow._start(job)
                assert len(tried) == flow_mod.MAX_ATTEMPTS
            assert len(set(tried)) == len(tried)        # every try on a worker not tried before
            assert flow.metrics.retries.n == min(failures, flow_mod.MAX_ATTEMPTS - 1)
        finally:
            await registry.stop()

    asyncio.run(scenario())


def test_decision_bench_times_the_real_decision() -> None:
    cfg = decision.DecisionBenchConfig(workers=(8,), requests=100)

    async def run():
        return await decision._run(cfg, ["multi-turn"])

    out = asyncio.run(run())
    (row,) = out["results"]
    assert row["decode_workers"] == 8 and row["requests"] == 100 and row["index_hashes"] > 0
    assert 0 < row["cpu"]["p50_us"] <= row["cpu"]["p99_us"]


def test_prompt_hasher_equals_the_chain_and_reuses_only_equal_blocks() -> None:
    rng = random.Random(11)
    system = [rng.randrange(1000) for _ in range(40)]
    hasher = PromptHasher(max_prompts=4)
    prompts = [system + [rng.randrange(1000) for _ in range(rng.randrange(0, 30))] for _ in range(20)]
    prompts += [p[:k] for p in prompts[:5] for k in (0, 3, 4, 17, 40, 41)]          # cut anywhere
    prompts += [system[:10] + [7] + system[11:]]                                   # one token differs
    prompts += [[rng.randrange(1000) for _ in range(rng.randrange(0, 50))] for _ in range(10)]  # > max_prompts keys
    for p in prompts:
        assert hasher.chain(p, BS) == block_hash_chain(p, BS), p
    assert hasher.num_reused_blocks > 0
    assert len(hasher._last) <= 4


def test_prompt_hasher_reuses_each_conversations_previous_turn() -> None:
    """Three conversations over one system prompt, their turns interleaved: each turn takes the
    whole chain of its own previous turn (not only the system prompt of the latest prompt), which
    it replaces; the memory stays within max_prompts."""
    rng = random.Random(12)
    system = [rng.randrange(1000) for _ in range(4 * BS)]
    convs = [system + [rng.randrange(1000) for _ in range(2 * BS)] for _ in range(3)]
    hasher = PromptHasher(max_prompts=3)
    for p in convs:
        assert hasher.chain(p, BS) == block_hash_chain(p, BS)
    for _turn in range(3):
        for i, p in enumerate(convs):
            before = hasher.num_reused_blocks
            longer = p + [rng.randrange(1000) for _ in range(3 * BS + 1)]
            assert hasher.chain(longer, BS) == block_hash_chain(longer, BS)
            assert hasher.num_reused_blocks - before == len(p) // BS       # all of its previous turn
            convs[i] = longer
    assert sum(len(v) for v in hasher._last.values()) == 3                  # one per conversation
    other = [rng.randrange(1000) for _ in range(2 * BS)]                    # a new first block
    assert hasher.chain(other, BS) == block_hash_chain(other, BS)
    assert sum(len(v) for v in hasher._last.values()) <= 3
