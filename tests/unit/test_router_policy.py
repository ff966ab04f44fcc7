"""Router placement, pure: the prefix index (longest-prefix match over KV events) and the policy."""
from __future__ import annotations

from pytest import approx

from pdserve.common.hashing import block_hash_chain  # noqa: E402
from pdserve.router.policy import (  # noqa: E402
    DecodeCandidate,
    PrefillCandidate,
    decode_score,
    fleet_pressure,
    pick_decode,
    pick_prefill,
    prefill_cost,
)
from pdserve.router.prefix_index import PrefixIndex  # noqa: E402

BS = 4


def test_match_is_longest_leading_run() -> None:
    chain = block_hash_chain(list(range(20)), BS)          # 5 blocks
    idx = PrefixIndex()
    idx.apply("a", stored=chain[:3], snapshot=True)
    idx.apply("b", stored=chain)                            # all 5
    idx.apply("c", stored=chain[1:])                        # no first block: no match
    assert idx.match(chain) == {"a": 3, "b": 5}
    assert idx.match(chain, workers=["a"]) == {"a": 3}
    assert idx.match([]) == {}


def test_evicted_and_snapshot_replace_the_view() -> None:
    chain = block_hash_chain(list(range(16)), BS)
    idx = PrefixIndex()
    idx.apply("a", stored=chain)
    idx.apply("a", evicted=[chain[2]])
    assert idx.match(chain) == {"a": 2}
    idx.apply("a", stored=[chain[0]], snapshot=True)        # a restarted: only block 0 now
    assert idx.match(chain) == {"a": 1}
    assert idx.num_blocks("a") == 1
    idx.remove_worker("a")
    assert idx.match(chain) == {} and idx.workers() == []


def test_shared_prefix_diverging_suffix() -> None:
    base = list(range(8))
    chain_x = block_hash_chain(base + [100, 101, 102, 103], BS)
    chain_y = block_hash_chain(base + [200, 201, 202, 203], BS)
    idx = PrefixIndex()
    idx.apply("a", stored=chain_x)
    assert idx.match(chain_y) == {"a": 2}                   # the two shared blocks only


def test_decode_prefers_cache_until_load_above_the_mean_outweighs_it() -> None:
    hot = DecodeCandidate("hot", matched_blocks=10, inflight_tokens=30)   # 40 cached tokens
    cold = DecodeCandidate("cold", matched_blocks=0, inflight_tokens=0)
    # mean load 15: hot is 15 above it -> 40 - 15 = 25; cold is below it -> 0
    assert decode_score(hot, BS, 1.0, mean_load=15) == 40 - 15
    assert decode_score(cold, BS, 1.0, mean_load=15) == 0
    assert pick_decode([hot, cold], prompt_tokens=48, block_size=BS, alpha=1.0) == "hot"
    # mean 50: hot is 50 above it -> 40 - 50 = -10 < 0
    busy = DecodeCandidate("hot", matched_blocks=10, inflight_tokens=100)
    assert decode_score(busy, BS, 1.0, mean_load=50) == -10
    assert pick_decode([busy, cold], 48, BS, alpha=1.0) == "cold"
    assert pick_decode([busy, cold], 48, BS, alpha=0.0) == "hot"        # pure cache affinity


def test_load_at_or_below_the_mean_costs_nothing() -> None:
    """The conversation's worker runs its previous turn (load 600 > its 400-token advantage
    over the system prompt held everywhere) but the fleet's mean is higher: it keeps the turn."""
    conv = DecodeCandidate("conv", matched_blocks=160, inflight_tokens=600)    # 640 cached
    peers = [DecodeCandidate(f"p{i}", matched_blocks=60, inflight_tokens=700) for i in range(3)]  # 240 cached
    # mean (600 + 3 * 700) / 4 = 675: conv 640 - 0; peers 240 - 25 = 215
    assert pick_decode([conv, *peers], 700, BS) == "conv"
    # charged from 0 (the old rule), conv would score 640 - 600 = 40 < an idle peer's 240
    idle = DecodeCandidate("idle", matched_blocks=60)
    # mean 1300 / 2 = 650: conv 640 - 0; idle 240
    assert pick_decode([conv, idle], 700, BS) == "conv"
    # really overloaded: 2,000 tokens; mean 1,000 -> conv 640 - 1,000 < idle 240
    heavy = DecodeCandidate("conv", matched_blocks=160, inflight_tokens=2000)
    assert pick_decode([heavy, idle], 700, BS) == "idle"


def test_no_match_anywhere_goes_to_the_least_loaded() -> None:
    a = DecodeCandidate("a", inflight_tokens=10)
    b = DecodeCandidate("b", inflight_tokens=5, inflight_requests=3)
    c = DecodeCandidate("c", inflight_tokens=50)
    assert pick_decode([a, b, c], 8, BS) == "b"           # all score 0 or less: lowest load


def test_decode_load_uses_worker_stats_too() -> None:
    a = DecodeCandidate("a", inflight_tokens=0, used_blocks=100, total_blocks=1000, other_tokens=400)  # other routers'
    b = DecodeCandidate("b", inflight_tokens=10, used_blocks=2, total_blocks=1000)
    assert pick_decode([a, b], 16, BS) == "b"


def test_decode_avoids_workers_without_room() -> None:
    full = DecodeCandidate("full", matched_blocks=2, used_blocks=99, total_blocks=100)
    roomy = DecodeCandidate("roomy", inflight_tokens=500, used_blocks=10, total_blocks=100)
    assert pick_decode([full, roomy], prompt_tokens=40, block_size=BS) == "roomy"
    assert pick_decode([full], prompt_tokens=40, block_size=BS) == "full"   # nobody fits: best anyway


def test_ties_rotate_and_prefer_fewer_requests() -> None:
    a, b = DecodeCandidate("a"), DecodeCandidate("b")
    assert {pick_decode([a, b], 8, BS, turn=t) for t in range(4)} == {"a", "b"}
    c = DecodeCandidate("c", inflight_requests=1)
    assert pick_decode([c, DecodeCandidate("d")], 8, BS) == "d"
    assert pick_decode([], 8, BS) is None


def test_prefill_fewest_uncached_prompt_tokens() -> None:
    p1 = PrefillCandidate("p1", inflight_prompt_tokens=100)
    p2 = PrefillCandidate("p2", inflight_prompt_tokens=20)
    assert pick_prefill([p1, p2], prompt_tokens=64, block_size=BS) == "p2"
    p1_cached = PrefillCandidate("p1", matched_blocks=16, inflight_prompt_tokens=60)   # 64 cached
    assert prefill_cost(p1_cached, 64, BS) == 60
    assert pick_prefill([p1_cached, p2], prompt_tokens=64, block_size=BS) == "p1"
    assert pick_prefill([], 64, BS) is None


def test_load_costs_in_proportion_to_the_fleets_pressure() -> None:
    """Pools of 2,048 blocks of 4 tokens: pressure 1 at a mean load of 2,048 * 4 / 4 = 2,048.
    A conversation's worker running earlier turns (1,800 tokens) while three peers idle: mean
    450 -> pressure 450 / 2,048; its excess 1,350 costs 1,350 * 450 / 2,048 = 296.63 of its 400
    cached tokens: 103.37 > the peers' 40, it keeps the turn."""
    conv = DecodeCandidate("conv", matched_blocks=100, inflight_tokens=1800, used_blocks=450, total_blocks=2048)
    peers = [DecodeCandidate(f"p{i}", matched_blocks=10, total_blocks=2048) for i in range(3)]
    assert fleet_pressure([conv, *peers], BS, 450) == 450 / 2048
    assert decode_score(conv, BS, 1.0, mean_load=450, pressure=450 / 2048) == approx(400 - 1350 * 450 / 2048)
    assert pick_decode([conv, *peers], prompt_tokens=500, block_size=BS) == "conv"
    # the same loads with unknown pools (pressure 1): 400 - 1,350 < 40 -> a peer
    bare = [DecodeCandidate(c.key, c.matched_blocks, c.inflight_tokens) for c in (conv, *peers)]
    assert fleet_pressure(bare, BS, 450) == 1.0
    assert pick_decode(bare, 500, BS) == "p0"
    # a heavier worker (3,000): mean 750, pressure 750 / 2,048; 400 - 2,250 * 0.3662 = -424 < 40
    heavy = DecodeCandidate("conv", matched_blocks=100, inflight_tokens=3000, total_blocks=2048)
    assert pick_decode([heavy, *peers], 500, BS) == "p0"


def test_a_saturated_fleet_balances_above_the_mean() -> None:
    """Mean 3,500 >= 2,048: pressure 1, the plain mean-relative rule. conv: 400 - (5,000 -
    3,500) = -1,100; the peers with 3,000: 40 - 0 -> the least loaded of them, then fewer
    requests (p1, p2), then round-robin: the first of them at or after the turn-th of all four
    keys (conv p0 p1 p2): turns 0-2 -> p1, turn 3 -> p2."""
    conv = DecodeCandidate("conv", matched_blocks=100, inflight_tokens=5000, total_blocks=2048)
    p0 = DecodeCandidate("p0", matched_blocks=10, inflight_tokens=3000, inflight_requests=2, total_blocks=2048)
    p1 = DecodeCandidate("p1", matched_blocks=10, inflight_tokens=3000, inflight_requests=1, total_blocks=2048)
    p2 = DecodeCandidate("p2", matched_blocks=10, inflight_tokens=3000, inflight_requests=1, total_blocks=2048)
    assert fleet_pressure([conv, p0, p1, p2], BS, 3500) == 1.0
    assert decode_score(conv, BS, 1.0, mean_load=3500) == -1100
    assert pick_decode([conv, p0, p1, p2], 500, BS, turn=0) == "p1"
    assert pick_decode([conv, p0, p1, p2], 500, BS, turn=2) == "p1"
    assert pick_decode([conv, p0, p1, p2], 500, BS, turn=3) == "p2"
    # the smallest pool sets the scale: one pool of 512 blocks -> pressure 1 at 512 * 4 / 4 = 512
    assert fleet_pressure([conv, DecodeCandidate("s", total_blocks=512)], BS, 256) == 0.5


def test_match_equals_a_per_worker_scan_on_random_views() -> None:
    """match() (bitmask AND along the chain) against the definition: per worker, the count of
    leading blocks of the chain it holds; views built by stores, evictions and removals."""
    import random

    rng = random.Random(3)
    chain = block_hash_chain(list(range(40 * BS)), BS)      # 40 blocks
    for _ in range(200):
        idx = PrefixIndex()
        views: dict[str, set[int]] = {}
        for w in (f"w{i}" for i in range(rng.randint(1, 12))):
            held = set(chain[:rng.randint(0, 40)]) | {h for h in chain if rng.random() < 0.1}
            views[w] = held
            idx.apply(w, stored=list(held))
            gone = {h for h in held if rng.random() < 0.1}
            idx.apply(w, evicted=list(gone))
            held -= gone
        for w in [w for w in views if rng.random() < 0.2]:
            idx.remove_worker(w)
            del views[w]
        length = rng.randint(0, 40)
        expect = {}
        for w, held in views.items():
            k = 0
            while k < length and chain[k] in held:
                k += 1
            if k:
                expect[w] = k
        assert idx.match(chain[:length]) == expect
