"""``--pd-policy fleet`` (pdserve/router/fleet_policy.py): the decode pick and the prefill place,
with hand-computed cases of the module docstring's formulas."""
from __future__ import annotations

import pytest

from pdserve.router.fleet_policy import (
    LEAN_SHARE,
    MAX_MOVES_PER_ROUND,
    FleetWorker,
    decide,
    dedicated_lean,
    full_rate,
    pick_decode,
    pick_moves,
    prefill_rate,
)
from pdserve.router.pd_policy import LOCAL, REMOTE, PdConfig

CFG = PdConfig(mode="fleet", slo_ttft_ms=1000.0, slo_tpot_ms=12.0, remote_overhead_ms=2.0,
               transfer_us_per_token=1.0)


def w(key: str, u: int = 1000, **kw) -> FleetWorker:
    return FleetWorker(key, u, **{"tokens_per_s": 40_000.0, **kw})


BUSY = 30_000.0    # W of a worker given 15k prompt tokens/s lately: >= LEAN_BUSY_SHARE (0.25) of 40k/s


def test_a_busy_prefiller_gets_no_decode_rows():
    # a: no rows, given 30k tokens in the last 2 s window = 15k/s >= 0.25 * 40k/s: the dedicated lean
    a, b = w("a", recent_tokens=BUSY), w("b", decode_rows=5, decode_step_ms=6.0)
    assert dedicated_lean([a, b], 12.0, 2.0) is a
    assert pick_decode([a, b], 12.0) is b                 # b has room (6 <= 0.7 * 12)
    # b has no room (11.5 > 8.4): every GPU's decode bandwidth is needed, the rows balance onto a
    over = w("b", decode_rows=40, decode_step_ms=11.5)
    assert dedicated_lean([a, over], 12.0, 2.0) is None and pick_decode([a, over], 12.0) is a
    # 9k tokens = 4.5k/s < 10k/s: not busy, so the rows balance: a has the fewest
    idle = w("a", recent_tokens=9000.0)
    assert dedicated_lean([idle, b], 12.0, 2.0) is None and pick_decode([idle, b], 12.0) is idle


def test_the_lean_is_the_fewest_rows_then_the_most_prompt_tokens():
    a, b = w("a", recent_tokens=BUSY), w("b", recent_tokens=BUSY + 1)
    assert dedicated_lean([a, b], 12.0, 2.0) is b and pick_decode([a, b], 12.0) is a
    # a 20k/s measured rate but 0.025 ms a prompt token: a full step computes 40k/s, so 15k/s is busy
    slow = w("a", recent_tokens=BUSY, tokens_per_s=20_000.0, ms_per_prompt_token=0.025)
    assert full_rate(slow, 8000.0) == pytest.approx(40_000.0)
    assert dedicated_lean([slow, w("b", decode_rows=1, decode_step_ms=5.0)], 12.0, 2.0) is slow


def test_decode_spills_to_the_fewest_rows_when_no_other_has_room():
    a = w("a", recent_tokens=9000.0, decode_rows=2, decode_step_ms=5.0)
    b = w("b", decode_rows=40, decode_step_ms=LEAN_SHARE * 12.0 + 0.1)
    assert pick_decode([a, b], 12.0) is a
    # a worker without rows always has room, whatever its last decode step was
    assert pick_decode([a, w("b", decode_step_ms=50.0)], 12.0).key == "b"


def test_decode_ties_go_to_the_cached_prefix_then_the_key():
    a, b, c = w("a"), w("b", u=200), w("c", u=900)
    assert pick_decode([a, b, c], 12.0) is b
    assert pick_decode([w("x"), w("z"), w("y")], 12.0).key == "x"


def test_a_tighter_tpot_leaves_fewer_with_room():
    a = w("a", recent_tokens=BUSY)                                   # the dedicated lean
    b, c = w("b", decode_rows=3, decode_step_ms=7.5), w("c", decode_rows=6, decode_step_ms=5.0)
    assert pick_decode([a, b, c], 12.0) is b              # both have room (<= 8.4): the fewer rows
    assert pick_decode([a, b, c], 8.0) is c               # only c has room (<= 5.6)


def test_prefill_rate_by_hand():
    # no rows: the measured rate, or 1000 / c when that is higher (a rate measured beside decode rows)
    assert prefill_rate(w("a"), 12.0, 8000.0) == 40_000.0
    assert prefill_rate(w("a", tokens_per_s=9000.0, ms_per_prompt_token=0.025), 12.0, 8000.0) == 40_000.0
    # rows: the guard's goal 12 ms a step on average (margin 0), 7.2 of them for prompts at 0.02 ms: 360 tokens a 12 ms
    busy = w("a", decode_rows=8, decode_step_ms=4.8, ms_per_prompt_token=0.02, max_num_batched_tokens=4096)
    assert prefill_rate(busy, 12.0, 8000.0) == pytest.approx(1000.0 * 360 / 12.0)
    # decode rows over the goal: the guard's floor, 32 tokens a step of 11 + 0.64 ms
    full = w("a", decode_rows=8, decode_step_ms=11.8, ms_per_prompt_token=0.02)
    assert prefill_rate(full, 12.0, 8000.0) == pytest.approx(1000.0 * 32 / (11.8 + 0.64))


def test_local_when_the_decode_worker_is_the_fastest_place():
    a, b = w("a", recent_tokens=BUSY), w("b")
    d, dec = decide([a, b], CFG)
    assert d == "b" and dec.kind == LOCAL and dec.prefill_key is None
    assert dec.ttft_ms == pytest.approx(25.0)             # 1000 tokens at 40k/s
    assert dec.prefill_tokens == 1000


def test_remote_where_the_prefix_is_cached():
    # b decodes (a leans); a holds all but 100 of the prompt's tokens
    a, b = w("a", u=100, recent_tokens=BUSY), w("b", u=2100)
    d, dec = decide([a, b], CFG)
    # a: 100 / 40k = 2.5 ms + 2 ms + 2100 tokens * 1 us = 6.6 ms; b: 2100 / 40k = 52.5 ms
    assert d == "b" and dec.kind == REMOTE and dec.prefill_key == "a"
    assert dec.ttft_ms == pytest.approx(6.6) and dec.prefill_tokens == 100


def test_decode_rows_wait_counts_against_a_local_prefill():
    # b decodes 20 rows at 0.02 ms a prompt token: a local 1000-token prompt costs them 400 ms of waiting
    a = w("a", recent_tokens=BUSY)
    b = w("b", decode_rows=20, decode_step_ms=5.0, ms_per_prompt_token=0.02, max_num_batched_tokens=4096)
    d, dec = decide([a, b], CFG)
    assert d == "b" and dec.kind == REMOTE and dec.prefill_key == "a"
    assert dec.ttft_ms == pytest.approx(25.0 + 2.0 + 1.0)


def test_over_the_ttft_share_the_fastest_wins():
    # a's queue is long: 30k tokens at 40k/s = 750 ms > 0.6 s; b has rows but a short queue
    a = w("a", recent_tokens=BUSY, queued_tokens=30_000)
    b = w("b", decode_rows=20, decode_step_ms=5.0, ms_per_prompt_token=0.02, max_num_batched_tokens=4096)
    d, dec = decide([a, b], CFG)
    assert d == "b" and dec.kind == LOCAL     # b: (12 - 5) / 0.02 = 350 a 12 ms step -> 1000 in ~34 ms


def test_prefill_only_workers_never_decode_and_decode_only_never_prefill_for_others():
    p = w("p", can_decode=False, recent_tokens=0.0)
    d_only = w("d", can_prefill=False, recent_tokens=9000.0)
    both = w("b", decode_rows=30, decode_step_ms=11.0)
    d, dec = decide([p, d_only, both], CFG)
    assert d in {"d", "b"} and dec.prefill_key in {None, "p"}
    d, dec = decide([p, w("d", can_prefill=False, decode_rows=3, decode_step_ms=6.0)], CFG)
    assert d == "d" and dec.kind == REMOTE and dec.prefill_key == "p"


def test_moves_off_a_worker_whose_rows_break_the_tpot():
    # a: 10 rows at 12.5 ms (> the goal 12, margin 0), b: 2 rows at 6 ms (room: <= 0.7 * 12) -> (10 - 2) // 2 = 4
    a = w("a", decode_rows=10, decode_step_ms=12.5)
    b = w("b", decode_rows=2, decode_step_ms=6.0)
    assert pick_moves([a, b], 12.0) == [("a", "b", 4)]
    # capped per round
    big = w("a", decode_rows=30, decode_step_ms=12.5)
    assert pick_moves([big, w("b")], 12.0) == [("a", "b", MAX_MOVES_PER_ROUND)]


def test_no_move_without_risk_room_or_a_gap():
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=10.0), w("b")], 12.0) == []     # TPOT kept
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=12.5),
                       w("b", decode_rows=3, decode_step_ms=9.0)], 12.0) == []               # b has no room
    assert pick_moves([w("a", decode_rows=2, decode_step_ms=12.5),
                       w("b", decode_rows=1, decode_step_ms=5.0)], 12.0) == []               # gap under 2
    assert pick_moves([w("a", decode_rows=8, decode_step_ms=12.5),
                       w("p", can_decode=False)], 12.0) == []                                # p never decodes
    # b is busy prefilling and c has room: b is dedicated, the decodes go to c
    busy, c = w("b", recent_tokens=BUSY), w("c", decode_rows=2, decode_step_ms=5.0)
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=12.5), busy, c], 12.0) == [("a", "c", 4)]
    # no other has room: b is not kept free, it takes them
    assert pick_moves([w("a", decode_rows=10, decode_step_ms=12.5), busy], 12.0) == [("a", "b", 4)]


def test_each_worker_is_in_one_move_per_round():
    a = w("a", decode_rows=12, decode_step_ms=12.5)
    b = w("b", decode_rows=10, decode_step_ms=12.5)
    c, d = w("c"), w("d", decode_rows=1, decode_step_ms=4.0)
    assert pick_moves([a, b, c, d], 12.0) == [("a", "c", 4), ("b", "d", 4)]
