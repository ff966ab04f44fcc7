"""``--pd-policy fleet`` (pdserve/router/fleet_policy.py): the decode pick and the prefill place,
with hand-computed cases of the module docstring's formulas."""
from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.router.fleet_policy import (
    MAX_MOVES_PER_ROUND,
    FleetWorker,
    colocated_tpot_ms,
    decide,
    dedicated_lean,
    pick_decode,
    pick_moves,
    prefill_rate,
)
from pdserve.router.pd_policy import LOCAL, REMOTE, PdConfig

CFG = PdConfig(mode="fleet", slo_ttft_ms=1000.0, slo_tpot_ms=12.0, remote_overhead_ms=2.0,
               transfer_us_per_token=1.0)


def w(key: str, u: int = 1000, **kw) -> FleetWorker:
    return FleetWorker(key, u, **{"tokens_per_s": 40_000.0, **kw})


def test_decode_stays_home_while_home_has_room():
    # home a: 5 rows at 6 ms, or 30 at 11 ms (both within the guard's goal, 11.4); b idle: home kept
    a, b = w("a", decode_rows=5, decode_step_ms=6.0), w("b")
    assert pick_decode([a, b], 12.0, home="a") is a
    assert pick_decode([w("a", decode_rows=30, decode_step_ms=11.0), b], 12.0, home="a").key == "a"
    # home's rows alone over the goal (11.5 > 11.4) while b has room: b decodes it
    over = w("a", decode_rows=40, decode_step_ms=11.5)
    assert pick_decode([over, b], 12.0, home="a") is b
    # nobody has room: home keeps it (every GPU's decode bandwidth is in use anyway)
    full = w("b", decode_rows=38, decode_step_ms=11.6)
    assert pick_decode([over, full], 12.0, home="a") is over


def test_without_home_the_fewest_rows_then_the_cached_prefix_then_the_key():
    a = w("a", decode_rows=2, decode_step_ms=5.0)
    b = w("b", decode_rows=40, decode_step_ms=11.5)
    assert pick_decode([a, b], 12.0) is a
    # a worker without rows always has room, whatever its last decode step was
    assert pick_decode([a, w("b", decode_step_ms=50.0)], 12.0).key == "b"
    assert pick_decode([w("a"), w("b", u=200), w("c", u=900)], 12.0).key == "b"
    assert pick_decode([w("x"), w("z"), w("y")], 12.0).key == "x"
    # an unknown home is no preference
    assert pick_decode([a, b], 12.0, home="gone") is a


def test_a_tighter_tpot_leaves_fewer_with_room():
    b, c = w("b", decode_rows=3, decode_step_ms=7.8), w("c", decode_rows=6, decode_step_ms=5.0)
    assert pick_decode([b, c], 12.0, home="b") is b      # 7.8 <= 11.4: within the goal, home keeps it
    assert pick_decode([b, c], 8.0, home="b") is c       # 7.8 > 7.6 = 8 * 0.95; c has room (5 <= 7.6)


BUSY = 40_000.0    # W of a worker given 20k prompt tokens/s lately (window 2 s): 10k/s for each of two


def test_colocated_tpot_by_hand():
    # t_co = (8 + 10) / 2 = 9 ms; c = (0.02 + 0.03) / 2 = 0.025 ms; P = 40,000 / 2 s / 2 = 10k/s:
    # a quarter of each second in prompt tokens, tpot_co = 9 / 0.75 = 12 ms
    a = w("a", decode_rows=10, decode_step_ms=8.0, ms_per_prompt_token=0.02, recent_tokens=20_000.0)
    b = w("b", decode_rows=30, decode_step_ms=10.0, ms_per_prompt_token=0.03, recent_tokens=20_000.0)
    assert colocated_tpot_ms([a, b], 2.0) == pytest.approx((9.0, 12.0))
    # c unmeasured: 1000 / R = 0.025 ms; no rows: (0, 0); prompts filling the GPUs: inf
    assert colocated_tpot_ms([w("a", decode_rows=1, decode_step_ms=9.0, recent_tokens=BUSY), w("b")],
                             2.0) == pytest.approx((9.0, 12.0))
    assert colocated_tpot_ms([w("a", recent_tokens=BUSY), w("b")], 2.0) == (0.0, 0.0)
    assert colocated_tpot_ms([w("a", decode_rows=1, recent_tokens=160_000.0), w("b")], 2.0)[1] == float("inf")


def test_a_lean_is_dedicated_when_the_prompts_put_colocations_tpot_at_risk():
    # b: 20 rows at 9 ms, c 0.02; P = 10k/s each: 9 / (1 - 0.2) = 11.25 ms > 0.9 * 12 = 10.8: a is lean
    a, b = w("a", recent_tokens=BUSY), w("b", decode_rows=20, decode_step_ms=9.0, ms_per_prompt_token=0.02)
    assert dedicated_lean([a, b], 12.0, 2.0) is a
    assert pick_decode([a, b], 12.0, home="a") is b       # home is the lean: b has room (9 <= 11.4)
    d, dec = decide([a, b], CFG, home="b")
    # a: 1000 / 40k = 25 ms + 2 ms + 1000 tokens * 1 us = 28 ms, no rows waiting;
    # b: 20 rows at 9 ms leave (11.4 - 9) / (0.02 * 11.4) = 10,526 tokens/s: 95 ms + 20 * 1000 * 0.02 ms
    assert d == "b" and dec.kind == REMOTE and dec.prefill_key == "a"
    assert dec.ttft_ms == pytest.approx(28.0)
    # fewer prompts: 4k/s each, 9 / 0.92 = 9.8 ms <= 10.8: co-location keeps it; a given 8k/s is
    # under LEAN_BUSY_SHARE (0.25) of its 40k/s: no lean
    assert dedicated_lean([w("a", recent_tokens=16_000.0), b], 12.0, 2.0) is None


def test_a_busy_lean_is_dedicated_where_the_others_have_headroom():
    # co-location not at risk (7 / (1 - 10k/s * 0.02) = 8.75 ms), but a is given 20k/s (>= 0.25 of
    # 40k/s) and the rows' steps (7 ms) are under ROOMY_SHARE (0.7) of the objective, 8.4 ms: a
    # GPU's decode bandwidth is to spare, so a prefills in prefill-sized steps (a leaves its rows)
    a = w("a", decode_rows=10, decode_step_ms=7.0, ms_per_prompt_token=0.02, recent_tokens=BUSY)
    b = w("b", decode_rows=20, decode_step_ms=7.0, ms_per_prompt_token=0.02)
    assert dedicated_lean([a, b], 12.0, 2.0) is a
    # at 9.5 ms the rows have no such headroom (> 8.4), but co-location's 9.5 / 0.8 = 11.9 ms is at
    # risk and the rows alone keep under 0.85 * 12 = 10.2: the prompts are the cause, a leans
    a9, b9 = replace(a, decode_step_ms=9.5), replace(b, decode_step_ms=9.5)
    assert dedicated_lean([a9, b9], 12.0, 2.0) is a9
    # 10.5 ms: neither headroom nor the prompts as the cause
    assert dedicated_lean([replace(a, decode_step_ms=10.5), replace(b, decode_step_ms=10.5)], 12.0, 2.0) is None
    # not busy (4.5k/s), and co-location at 7 / (1 - 2,250/s * 0.02) = 7.3 ms: no lean
    assert dedicated_lean([replace(a, recent_tokens=9000.0), b], 12.0, 2.0) is None


def test_a_lean_begins_only_where_the_prompts_are_the_cause():
    # both hold rows: t_co 10.5 > 0.85 * 12 = 10.2, the rows alone are near the objective (no lean);
    # at 9 ms (<= 10.2) the prompts are the cause: 9 / 0.75 = 12 > 10.8, a (fewer rows) leans
    slow = [w("a", decode_rows=10, decode_step_ms=10.5, recent_tokens=BUSY),
            w("b", decode_rows=12, decode_step_ms=10.5)]
    assert dedicated_lean(slow, 12.0, 2.0) is None
    fast = [w("a", decode_rows=10, decode_step_ms=9.0, recent_tokens=BUSY),
            w("b", decode_rows=12, decode_step_ms=9.0)]
    assert dedicated_lean(fast, 12.0, 2.0).key == "a"
    # once dedicated (no rows of its own) it stays while tpot_co is at risk, whatever t_co
    kept = [w("a", recent_tokens=BUSY), w("b", decode_rows=40, decode_step_ms=11.5)]
    assert dedicated_lean(kept, 12.0, 2.0).key == "a"


def test_a_dedicated_lean_prefills_even_over_the_ttft_share_while_the_rows_wait_longer():
    # lean a (tpot_co = 9 / (1 - 10k/s * 0.025 ms) = 12 > 10.8): (31,000 queued + 1,000) / 40k/s =
    # 800 ms + 2 + 1 = 803 ms, over the 600 ms share; b (40 rows at 9 ms, guarded):
    # (11.4 - 9) / (0.025 * 11.4) = 8,421 tokens/s: 118.75 ms, which keeps the share, but costs
    # 118.75 + 40 rows * 1000 * 0.025 = 1,118.75 ms of waiting: a
    a = w("a", queued_tokens=31_000, recent_tokens=BUSY)
    b = w("b", decode_rows=40, decode_step_ms=9.0, ms_per_prompt_token=0.025)
    d, dec = decide([a, b], CFG, home="b")
    assert d == "b" and dec.kind == REMOTE and dec.prefill_key == "a"
    assert dec.ttft_ms == pytest.approx(803.0)


def test_the_lean_is_given_back_when_the_others_break_the_objective_or_the_prompts_ease():
    a = w("a", recent_tokens=BUSY)
    near = w("b", decode_rows=40, decode_step_ms=11.5)      # no room (11.5 > 11.4) but keeps 12 ms
    assert dedicated_lean([a, near], 12.0, 2.0) is a
    assert pick_decode([a, near], 12.0, home="a") is near  # never the dedicated lean, even without room
    over = w("b", decode_rows=40, decode_step_ms=12.5)      # 12.5 > 12: every GPU's decode is needed
    assert dedicated_lean([a, over], 12.0, 2.0) is None and pick_decode([a, over], 12.0, home="a") is a
    idle = w("a", recent_tokens=9000.0)                     # 2,250/s each: 6 / (1 - 0.056) = 6.4 ms
    b = w("b", decode_rows=5, decode_step_ms=6.0)
    assert dedicated_lean([idle, b], 12.0, 2.0) is None
    d, dec = decide([idle, b], CFG, home="a")
    assert d == "a" and dec.kind == LOCAL                   # co-location
    assert dedicated_lean([a], 12.0, 2.0) is None           # one worker: nothing to lean on


def test_prefill_rate_by_hand():
    # no rows: the measured rate, or 1000 / c when that is higher (a rate measured beside decode rows)
    assert prefill_rate(w("a"), 12.0, 8000.0) == 40_000.0
    assert prefill_rate(w("a", tokens_per_s=9000.0, ms_per_prompt_token=0.025), 12.0, 8000.0) == 40_000.0
    # rows: the guard's goal 11.4 ms a step on average (12 ms, margin 0.05), 6.6 of them for prompts at
    # 0.02 ms: 330 tokens every 11.4 ms
    busy = w("a", decode_rows=8, decode_step_ms=4.8, ms_per_prompt_token=0.02, max_num_batched_tokens=4096)
    assert prefill_rate(busy, 12.0, 8000.0) == pytest.approx(1000.0 * 330 / 11.4)
    # decode rows over the goal: the guard's floor, 32 tokens a step of 11 + 0.64 ms
    full = w("a", decode_rows=8, decode_step_ms=11.8, ms_per_prompt_token=0.02)
    assert prefill_rate(full, 12.0, 8000.0) == pytest.approx(1000.0 * 32 / (11.8 + 0.64))


def test_an_unguarded_worker_prefills_a_budget_chunk_every_step():
    # budget 512, 12 rows: 500 prompt tokens a step of 8 + 0.02 * 500 = 18 ms: 27,778 tokens/s
    free = w("a", decode_rows=12, decode_step_ms=8.0, ms_per_prompt_token=0.02, max_num_batched_tokens=512,
             guarded=False)
    assert prefill_rate(free, 12.0, 8000.0) == pytest.approx(1000.0 * 500 / 18.0)
    # the measured rate caps it
    slow = w("a", decode_rows=12, decode_step_ms=8.0, ms_per_prompt_token=0.02, max_num_batched_tokens=512,
             guarded=False, tokens_per_s=10_000.0)
    assert prefill_rate(slow, 12.0, 8000.0) == 10_000.0


def test_local_on_home_while_it_keeps_the_ttft():
    # home b has 20 rows at 5 ms: (11.4 - 5) / 0.02 = 320 prompt tokens every 11.4 ms = 28,070/s, so
    # 1000 tokens in 35.6 ms <= 0.6 s: local, though a (no rows, 40k/s) would be faster
    a = w("a")
    b = w("b", decode_rows=20, decode_step_ms=5.0, ms_per_prompt_token=0.02, max_num_batched_tokens=4096)
    d, dec = decide([a, b], CFG, home="b")
    assert d == "b" and dec.kind == LOCAL and dec.prefill_key is None
    assert dec.ttft_ms == pytest.approx(1000.0 / (1000.0 * 6.4 / (0.02 * 11.4)) * 1000.0)
    assert dec.prefill_tokens == 1000


def test_remote_when_home_would_break_the_ttft():
    # home b's queue: 20k tokens at 28,070/s = 748 ms > 600; a holds all but 100 of the prompt
    a = w("a", u=100)
    b = w("b", u=2100, queued_tokens=20_000, decode_rows=20, decode_step_ms=5.0, ms_per_prompt_token=0.02)
    d, dec = decide([a, b], CFG, home="b")
    # a: 100 / 40k = 2.5 ms + 2 ms + 2100 tokens * 1 us = 6.6 ms
    assert d == "b" and dec.kind == REMOTE and dec.prefill_key == "a"
    assert dec.ttft_ms == pytest.approx(6.6) and dec.prefill_tokens == 100


def test_among_the_others_the_decode_rows_wait_counts():
    # home h is over its TTFT share; a (no rows) and b (20 rows at 0.02 ms a token) both keep it:
    # a costs 25 + 3 ms; b 1000 / 28,070/s + 3 + 20 * 1000 * 0.02 = 435.6 ms: a
    h = w("h", queued_tokens=40_000, decode_rows=1, decode_step_ms=5.0, ms_per_prompt_token=0.02)
    a = w("a")
    b = w("b", decode_rows=20, decode_step_ms=5.0, ms_per_prompt_token=0.02)
    d, dec = decide([h, a, b], CFG, home="h")
    assert d == "h" and dec.kind == REMOTE and dec.prefill_key == "a"
    assert dec.ttft_ms == pytest.approx(25.0 + 2.0 + 1.0)


def test_over_the_ttft_share_everywhere_the_fastest_wins():
    # every place is over 0.6 s: the lowest ttft, here home's own queue (750 ms) beats a's (1000 ms + 3)
    h = w("h", queued_tokens=29_000)
    a = w("a", queued_tokens=39_000)
    d, dec = decide([h, a], CFG, home="h")
    assert d == "h" and dec.kind == LOCAL and dec.ttft_ms == pytest.approx(750.0)


def test_prefill_only_workers_never_decode_and_decode_only_never_prefill_for_others():
    p = w("p", can_decode=False, recent_tokens=0.0)
    d_only = w("d", can_prefill=False, recent_tokens=9000.0)
    both = w("b", decode_rows=30, decode_step_ms=11.0)
    d, dec = decide([p, d_only, both], CFG)
    assert d in {"d", "b"} and dec.prefill_key in {None, "p"}
    d, dec = decide([p, w("d", can_prefill=False, decode_rows=3, decode_step_ms=6.0)], CFG)
    assert d == "d" and dec.kind == REMOTE and dec.prefill_key == "p"
    # a busy prefill worker (29,000 queued: 750 ms) still prefills for an idle role-decode D
    # (25 ms on its own): role decode prefills only where no worker can
    busy_p = w("p", can_decode=False, queued_tokens=29_000)
    d, dec = decide([busy_p, w("d", can_prefill=False)], CFG)
    assert d == "d" and dec.kind == REMOTE and dec.prefill_key == "p"
    d, dec = decide([w("d", can_prefill=False)], CFG)
    assert d == "d" and dec.kind == LOCAL


def test_moves_off_a_worker_whose_rows_break_the_tpot():
    # a: 10 rows at 12.5 ms (> the objective, 12), b: 2 rows at 6 ms (room: <= 11.4) -> (10 - 2) // 2 = 4
    a = w("a", decode_rows=10, decode_step_ms=12.5)
    b = w("b", decode_rows=2, decode_step_ms=6.0)
    assert pick_moves([a, b], 12.0) == [("a", "b", 4)]
    # capped per round
    big = w("a", decode_rows=30, decode_step_ms=12.5)
    assert pick_moves([big, w("b")], 12.0) == [("a", "b", MAX_MOVES_PER_ROUND)]


def test_no_move_without_risk_room_or_a_gap():
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=10.0), w("b")], 12.0) == []     # TPOT kept
    # no room (11.8 > 11.4) but the rows keep the objective: a move's stall would cost more than it gains
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=11.8), w("b")], 12.0) == []
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=12.5),
                       w("b", decode_rows=3, decode_step_ms=11.6)], 12.0) == []              # b has no room
    assert pick_moves([w("a", decode_rows=2, decode_step_ms=12.5),
                       w("b", decode_rows=1, decode_step_ms=5.0)], 12.0) == []               # gap under 2
    assert pick_moves([w("a", decode_rows=8, decode_step_ms=12.5),
                       w("p", can_decode=False)], 12.0) == []                                # p never decodes
    # never onto a dedicated lean: c leans (P = 60k / 2 s / 3 = 10k/s each, c 0.025 ms:
    # (12.5 + 5) / 2 / 0.75 = 11.7 ms > 10.8) while b has room
    lean, b3 = w("c", recent_tokens=60_000.0), w("b", decode_rows=3, decode_step_ms=5.0)
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=12.5), b3, lean], 12.0) == [("a", "b", 3)]
    # the destination is the fewest rows among those with room
    b, c = w("b", decode_rows=3, decode_step_ms=5.0), w("c", decode_rows=2, decode_step_ms=5.0)
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=12.5), b, c], 12.0) == [("a", "c", 4)]


def test_each_worker_is_in_one_move_per_round():
    a = w("a", decode_rows=12, decode_step_ms=12.5)
    b = w("b", decode_rows=10, decode_step_ms=12.5)
    c, d = w("c"), w("d", decode_rows=1, decode_step_ms=4.0)
    assert pick_moves([a, b, c, d], 12.0) == [("a", "c", 4), ("b", "d", 4)]
