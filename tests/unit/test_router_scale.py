"""Scale-out decisions, pure and hand-computed: the prefix index's sequence numbers and bound,
the policy's replica-aware load and baselines, the simulation's cost model and figures."""
from __future__ import annotations

from types import SimpleNamespace

from bench.sim import analysis
from bench.sim.cost import CostModel, take_batch
from pdserve.common.hashing import block_hash_chain
from pdserve.router.policy import (
    DecodeCandidate,
    PrefillCandidate,
    decode_load_tokens,
    pick_decode,
    pick_prefill,
    prefill_cost,
)
from pdserve.router.prefix_index import PrefixIndex

BS = 4


def test_index_ignores_what_the_snapshot_covers_and_drops_on_a_gap() -> None:
    chain = block_hash_chain(list(range(16)), BS)          # 4 blocks
    idx = PrefixIndex()
    assert idx.apply("a", stored=chain[:2], snapshot=True, seq=5)
    assert idx.apply("a", stored=[chain[1]], seq=4)          # older than the snapshot: ignored
    assert idx.apply("a", stored=[chain[2]], seq=6)          # next: applied
    assert idx.match(chain) == {"a": 3}
    assert not idx.apply("a", stored=[chain[3]], seq=8)      # 7 lost: the view is dropped
    assert idx.match(chain) == {} and idx.num_resyncs == 1
    assert idx.apply("a", stored=chain, snapshot=True, seq=8)  # re-subscribed: repaired
    assert idx.match(chain) == {"a": 4}


def test_index_is_bounded_by_the_pool() -> None:
    chain = block_hash_chain(list(range(16)), BS)
    idx = PrefixIndex()
    assert idx.apply("a", stored=chain[:3], snapshot=True, seq=1, capacity=3)
    assert not idx.apply("a", stored=[chain[3]], seq=2)       # 4 hashes in a pool of 3: impossible
    assert idx.num_hashes() == 0 and idx.workers() == []
    assert idx.apply("b", stored=chain)                       # unnumbered workers: unchecked
    assert idx.match(chain) == {"b": 4}


def test_other_replicas_load_counts_and_stats_floor() -> None:
    # this router: 100 tokens live; other replicas: 300 from the last GetStats -> 400
    c = DecodeCandidate("a", inflight_tokens=100, other_tokens=300, used_blocks=50)
    assert decode_load_tokens(c, BS) == 400
    # the raw stats figure (60 blocks * 4 = 240) is not load: it lags this router's own requests
    assert decode_load_tokens(DecodeCandidate("b", inflight_tokens=100, used_blocks=60), BS) == 100
    busy = DecodeCandidate("busy", matched_blocks=10, other_tokens=100)   # mean 50: 40 - 50 = -10
    idle = DecodeCandidate("idle")                                        # 0
    assert pick_decode([busy, idle], 48, BS) == "idle"
    p = PrefillCandidate("p", matched_blocks=2, inflight_prompt_tokens=5, other_prompt_tokens=7)
    assert prefill_cost(p, 20, BS) == (20 - 8) + 5 + 7


def test_baselines() -> None:
    hot = DecodeCandidate("a", matched_blocks=10, inflight_tokens=30)     # kv, mean 25: 40 - 5 = 35
    cold = DecodeCandidate("b", inflight_tokens=20)                       # kv: 0 (below the mean)
    assert pick_decode([hot, cold], 48, BS) == "a"
    assert pick_decode([hot, cold], 48, BS, mode="least-loaded") == "b"  # 20 < 30
    assert [pick_decode([cold, hot], 48, BS, turn=t, mode="round-robin") for t in range(3)] == ["a", "b", "a"]
    p1 = PrefillCandidate("p1", matched_blocks=5, inflight_prompt_tokens=10)   # kv: 0 + 10
    p2 = PrefillCandidate("p2", inflight_prompt_tokens=5)                        # kv: 20 + 5
    assert pick_prefill([p1, p2], 20, BS) == "p1"
    assert pick_prefill([p1, p2], 20, BS, mode="least-loaded") == "p2"
    assert pick_prefill([p1, p2], 20, BS, turn=1, mode="round-robin") == "p2"


def test_cost_model_and_prefill_batches() -> None:
    m = CostModel(scale=2.0)
    assert m.prefill_ms(1000) == 2.0 * (5.0 + 80.0)
    assert m.decode_ms(10, 20_000) == 2.0 * (8.0 + 0.2 + 1.0)
    assert take_batch([3000, 4000, 2000], 8192) == 2
    assert take_batch([9000, 10], 8192) == 1                 # a large prompt runs alone
    assert take_batch([], 8192) == 0


def _stats(hit=0, query=0, ctx=0, ch=0, opened=0, running=0):
    return SimpleNamespace(prefix_cache_hit_tokens=hit, prefix_cache_query_tokens=query, num_running=running,
                           num_running_context_tokens=ctx, num_open_kv_channels=ch, num_kv_channels_opened=opened)


def test_simulation_figures() -> None:
    samples = [(0.0, {"a": _stats(0, 0, 100), "b": _stats(0, 0, 300)}),
               (2.0, {"a": _stats(50, 100, 200), "b": _stats(10, 100, 200)}),
               (4.0, {"a": _stats(90, 200, 0, 3, 5)})]                         # b died
    assert analysis.hit_rate(samples, ["a", "b"]) == (90 + 10) / (200 + 100)
    # loads 100/300: max 300 / mean 200 = 1.5; 200/200: 1.0; the last sample has no load
    assert analysis.imbalance(samples, ["a", "b"]) == {"mean": 1.25, "p90": 1.5, "samples": 2, "floor_mean": 0.0,
                                                      "mean_requests_in_flight": 0.0, "saturated_mean": 0.0,
                                                      "saturated_samples": 0}
    # 3 requests on 2 workers: some worker runs 2 -> 2 / 1.5 = 1.333 at best; 4 on 2: 1.0
    few = [(0.0, {"a": _stats(ctx=200, running=2), "b": _stats(ctx=100, running=1)}),
           (2.0, {"a": _stats(ctx=200, running=2), "b": _stats(ctx=200, running=2)})]
    got = analysis.imbalance(few, ["a", "b"])
    assert got["floor_mean"] == (2 / 1.5 + 1.0) / 2 and got["mean_requests_in_flight"] == 3.5
    assert got["saturated_samples"] == 0               # 4 requests on 2 workers: < 4 per worker
    busy = [(0.0, {"a": _stats(ctx=900, running=8), "b": _stats(ctx=700, running=8)})]
    assert analysis.imbalance(busy, ["a", "b"])["saturated_mean"] == 900 / 800
    assert analysis.hit_rate_timeline(samples, ["a", "b"]) == [(2.0, 60 / 200), (4.0, 40 / 100)]
    assert analysis.channel_counts(samples, ["a"]) == {"max_open_per_worker": 3, "mean_open_per_worker_at_end": 3.0,
                                                      "opened_total": 5}
    page = ('pdserve_router_decision_seconds_bucket{le="0.0001"} 50.0\n'
            'pdserve_router_decision_seconds_bucket{le="0.0002"} 100.0\n'
            'pdserve_router_decision_seconds_bucket{le="+Inf"} 100.0\n')
    b = analysis.decision_buckets(page)
    assert b == [(1e-4, 50.0), (2e-4, 100.0), (float("inf"), 100.0)]
    # rank 99 of 100 lies in (1e-4, 2e-4]: 1e-4 + 1e-4 * (99 - 50) / 50
    assert abs(analysis.histogram_quantile(b, 0.99) - 1.98e-4) < 1e-12
    assert analysis.merge_buckets([b, b])[1] == (2e-4, 200.0)


def test_ttft_by_turn_and_counter_total() -> None:
    # 10 requests: run p90 = sorted[9] = 1.0 s; a failed request (0) is skipped
    ttfts = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 0.0]
    turns = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    by = analysis.ttft_by_turn(ttfts, turns)
    assert set(by) == {0, 1}
    assert by[0] == {"requests": 5, "p50_ttft_ms": 300.0, "p90_ttft_ms": 500.0, "above_run_p90": 0}
    assert by[1]["requests"] == 5 and by[1]["p50_ttft_ms"] == 800.0 and by[1]["p90_ttft_ms"] == 1000.0
    assert by[1]["above_run_p90"] == 0          # nothing is above the largest value
    assert analysis.ttft_by_turn([0.0], [0]) == {}
    page = ('# HELP pdserve_router_migrations_total x\npdserve_router_migrations_total 3.0\n'
            'pdserve_router_retries_total{role="decode"} 2.0\npdserve_router_retries_total{role="prefill"} 1.0\n'
            'pdserve_router_retries_created 1.7e9\n')
    assert analysis.counter_total(page, "pdserve_router_migrations") == 3.0
    assert analysis.counter_total(page, "pdserve_router_retries") == 3.0
    assert analysis.counter_total(page, "pdserve_router_absent") == 0.0
