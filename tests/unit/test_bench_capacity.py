"""SLO capacity (pdserve.loadtest.capacity): attainment on synthetic records, and the bisection on a
synthetic deployment whose runs hold up to a known rate (no server)."""
from __future__ import annotations

import pytest

from pdserve.loadtest import capacity, metrics
from pdserve.loadtest.capacity import CapacitySearch, find_capacity
from pdserve.loadtest.metrics import RequestRecord, compute_metrics

SLO = {"ttft": 100.0, "tpot": 10.0, "itl_p99": 30.0}


def _rec(i: int, ttft: float, gap: float, n: int = 5, code: str = "OK") -> RequestRecord:
    """A request sent at i, first token after ``ttft`` s, then n - 1 tokens ``gap`` s apart."""
    times = [i + ttft + k * gap for k in range(n)]
    return RequestRecord(index=i, send_time=float(i), msg_times=times, msg_tokens=[1] * n, end_time=times[-1],
                         code=code, output_tokens=n)


def test_attainment_counts_every_request_sent_and_itl_p99_bounds_the_run() -> None:
    recs = [_rec(i, 0.050, 0.008) for i in range(7)]          # meet both: ttft 50 ms, tpot 8 ms
    recs.append(_rec(7, 0.150, 0.008))                        # ttft 150 ms: misses
    recs.append(_rec(8, 0.050, 0.012))                        # tpot 12 ms: misses
    recs.append(_rec(9, 0.050, 0.008, code="UNAVAILABLE"))    # failed: misses
    m = compute_metrics(recs, duration_s=10.0, slo=SLO)
    assert m["slo_attainment"] == pytest.approx(0.7)          # 7 of the 10 sent
    assert m["good_completed"] == 7 and m["request_goodput"] == pytest.approx(0.7)
    # ITLs of the 9 successes: 32 gaps of 8 ms, 4 of 12 ms -> p99 (linear) = 12 ms
    assert m["itl_p99_ms"] == pytest.approx(12.0) and m["itl_p99_ok"]
    assert not capacity.holds(m)
    assert capacity.holds({**m, "slo_attainment": 0.9})
    assert not capacity.holds({**m, "slo_attainment": 0.95, "itl_p99_ok": False})
    stutter = compute_metrics([_rec(0, 0.05, 0.008, n=101)] + [_rec(1, 0.05, 0.040, n=3)], 5.0, slo=SLO)
    assert stutter["itl_p99_ms"] > 30.0 and not stutter["itl_p99_ok"]


def test_slo_parsing_takes_the_run_bound() -> None:
    assert metrics.parse_slo("ttft_ms=1000,tpot_ms=12,itl_p99_ms=30") == {"ttft": 1000.0, "tpot": 12.0,
                                                                           "itl_p99": 30.0}
    with pytest.raises(ValueError, match="itl_p99_ms"):
        metrics.parse_slo("itl_p50_ms=3")


def _deployment(limit: float, ran: list[float]):
    def run(rate: float) -> tuple[bool, dict]:
        ran.append(rate)
        return rate <= limit, {"slo_attainment": 1.0 if rate <= limit else 0.5}
    return run


def test_bisection_from_a_rate_list() -> None:
    ran: list[float] = []
    cap = find_capacity(CapacitySearch(rates=(16, 4, 32, 8)), _deployment(13.4, ran))
    # 4, 8 hold, 16 fails: (8, 16) -> 12 holds, 14 fails, 13 holds: (13, 14)
    assert ran == [4, 8, 16, 12, 14, 13]
    assert (cap.capacity, cap.upper, cap.bounded) == (13, 14, True)
    assert [p["holds"] for p in cap.points] == [True, True, False, True, False, True]


def test_bisection_from_a_bracket_and_its_edges() -> None:
    ran: list[float] = []
    cap = find_capacity(CapacitySearch(bracket=(4, 40)), _deployment(21.0, ran))
    # 4 and 40 run first; then 22 fails, 13 holds, 17.5, 19.75, 20.875 hold, 21.438 fails
    assert ran[:2] == [4, 40] and cap.capacity <= 21.0 < cap.upper and cap.upper - cap.capacity <= 1.0
    low: list[float] = []
    assert find_capacity(CapacitySearch(bracket=(4, 40)), _deployment(2.5, low)).capacity == 2   # 4 fails: (0, 4)
    assert low == [4, 2, 3]
    high = find_capacity(CapacitySearch(bracket=(4, 40)), _deployment(100, []))
    assert (high.capacity, high.upper, high.bounded) == (40, None, False)       # a lower bound only
    every = find_capacity(CapacitySearch(rates=(1, 2)), _deployment(100, []))
    assert (every.capacity, every.bounded) == (2, False)
    never = find_capacity(CapacitySearch(rates=(1, 2)), _deployment(0.1, []))
    assert (never.capacity, never.upper) == (0.0, 1)


def test_search_is_validated_and_reported() -> None:
    with pytest.raises(ValueError):
        CapacitySearch()
    with pytest.raises(ValueError):
        CapacitySearch(rates=(1,), bracket=(1, 2))
    with pytest.raises(ValueError):
        CapacitySearch(bracket=(5, 5))
    assert capacity.parse_bracket("4:40") == (4.0, 40.0)
    cap = find_capacity(CapacitySearch(rates=(4, 8)), _deployment(5, []))
    table = capacity.markdown([("adaptive", cap)], {"ttft": 1000.0, "tpot": 12.0}, 0.9)
    # 4 holds, 8 fails, 6 fails, 5 holds
    assert "| adaptive | 5 | 6 | 4 | 100.0% | - |" in table and "ttft <= 1000 ms" in table
    assert cap.as_dict()["bounded"] is True


def test_capacity_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    from pdserve.loadtest import plots
    rows = [("disagg", find_capacity(CapacitySearch(rates=(4, 8)), _deployment(5, []))),
            ("adaptive", find_capacity(CapacitySearch(rates=(4, 8)), _deployment(100, [])))]
    png = plots.capacity_compare(rows, tmp_path / "c.png", "test")
    assert png.stat().st_size > 1000
