"""The equality check of bench/disagg_gpu.py on hand-made results: identical counts, the first
differing positions, errors, and with top logprobs the near ties at the first differing token
(each side's token among the other's top choices, with each side's margin)."""
from __future__ import annotations

import pytest

from bench.disagg_gpu import compare, divergence


def test_without_logprobs_counts_identical_positions_and_errors():
    a = [([1, 2, 3], 0.1), ([4, 5, 6], 0.1), ("UNAVAILABLE: gone", None), ([7, 8], 0.1)]
    b = [([1, 2, 3], 0.2), ([4, 9, 6], 0.2), ([1, 1, 1], 0.2), ([7, 8, 9], 0.2)]
    eq = compare(a, b)
    assert eq["identical"] == 1 and eq["requests"] == 4
    assert eq["first_divergence_positions"] == [1, None]          # [7, 8] is a prefix of [7, 8, 9]
    assert eq["errors"] == {"disaggregated": {"UNAVAILABLE: gone": 1}, "co_located": {}}
    assert "near_ties" not in eq and "divergences" not in eq


def test_a_swap_of_the_two_top_tokens_is_a_near_tie_with_both_margins():
    top = {5: -0.1, 9: -0.1005}
    a = ([4, 5, 6], 0.1, [{4: -0.01}, top, {6: -0.2}])             # disaggregated took 5
    b = ([4, 9, 6], 0.1, [{4: -0.01}, {9: -0.1001, 5: -0.1003}, {6: -0.2}])   # co-located took 9
    d = divergence(a, b)
    assert d["position"] == 1 and d["tokens"] == [5, 9] and d["swapped"] is True
    assert d["margin_disaggregated"] == pytest.approx(0.0005)
    assert d["margin_co_located"] == pytest.approx(0.0002)
    eq = compare([a, ([1], 0.1, [{1: 0.0}])], [b, ([1], 0.1, [{1: 0.0}])])
    assert eq["identical"] == 1 and eq["near_ties"] == 1 and eq["divergences"] == [d]


def test_a_token_outside_the_other_sides_top_choices_is_not_a_near_tie():
    a = ([3, 7], 0.1, [{3: -0.5, 8: -1.0}, {7: -0.2, 1: -2.0}])
    b = ([8, 7], 0.1, [{8: -0.4, 2: -1.5}, {7: -0.2, 1: -2.0}])   # 3 is not among b's top two
    d = divergence(a, b)
    assert d["position"] == 0 and d["swapped"] is False
    assert d["margin_disaggregated"] == pytest.approx(0.5) and d["margin_co_located"] is None
    assert compare([a], [b])["near_ties"] == 0
