"""The ``phases`` workload (pdserve/loadtest/phases.py): windows and rates of the arrival process,
the requests of each phase and their variants, per-phase metrics on hand-made records, the CLI,
and one short run against an in-process gRPC server."""
from __future__ import annotations

import math
from collections import Counter

import pytest
from generation_server import serve

from pdserve.cli import build_parser
from pdserve.loadtest import arrivals, compare, phases, runner, schedule
from pdserve.loadtest.datasets import BenchRequest
from pdserve.loadtest.metrics import RequestRecord, compute_metrics
from pdserve.loadtest.schedule import Schedule, Window
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

approx = pytest.approx
SP_PREFIX = phases.WORKLOADS["shared-prefix"]["prefix_len"]


# ---- arrival times and windows ---------------------------------------------------------------
def test_windows_cycle_through_the_phases_and_hold_their_arrivals() -> None:
    times, phase_of, windows = phases.phase_times(None, 2.0, seed=0, phase_seconds=10, cycles=2)
    assert [(w.phase, w.start, w.end, w.rate) for w in windows] == [
        ("prefill-heavy", 0, 10, 2.0), ("shared-prefix", 10, 20, 6.0), ("decode-heavy", 20, 30, 4.0),
        ("prefill-heavy", 30, 40, 2.0), ("shared-prefix", 40, 50, 6.0), ("decode-heavy", 50, 60, 4.0)]
    assert times == sorted(times) and len(times) == len(phase_of)
    for t, i in zip(times, phase_of):
        (w,) = [w for w in windows if w.start <= t < w.end]
        assert w.phase == phases.PHASES[i]


def test_fixed_intervals_give_hand_counted_windows() -> None:
    # burstiness inf: one arrival every 1/rate s after each window's start, none at its end.
    # base 2, multipliers 1, 2, 4 -> gaps 0.5, 0.25, 0.125 s (exact in binary) in 10-s windows
    times, phase_of, _ = phases.phase_times(None, 2.0, phase_seconds=10, multipliers=(1, 2, 4), burstiness=math.inf)
    assert Counter(phase_of) == {0: 19, 1: 39, 2: 79}
    assert times[:2] == [0.5, 1.0] and times[19] == 10.25 and times[-1] == 29.875


def test_multipliers_are_honoured_over_a_long_run() -> None:
    # 60 cycles of 10-s windows at base 2 req/s: expected 1,200 / 3,600 / 2,400 (Poisson sd 35 / 60 / 49)
    _, phase_of, windows = phases.phase_times(None, 2.0, seed=7, phase_seconds=10, cycles=60)
    counts = Counter(phase_of)
    assert len(windows) == 180
    for i, expect in enumerate((1200, 3600, 2400)):
        assert counts[i] == approx(expect, rel=0.08)
    _, other, _ = phases.phase_times(None, 2.0, seed=7, phase_seconds=10, multipliers="3,1,1", cycles=60)
    assert Counter(other)[0] / Counter(other)[1] == approx(3.0, rel=0.15)


def test_window_times_restart_a_poisson_process() -> None:
    t = arrivals.window_times(5.0, 105.0, 4.0, seed=[1, 2])
    assert t.min() > 5.0 and t.max() < 105.0 and len(t) == approx(400, rel=0.15)
    assert list(t) == list(arrivals.window_times(5.0, 105.0, 4.0, seed=[1, 2]))
    with pytest.raises(ValueError):
        arrivals.window_times(0.0, 1.0, math.inf)


def test_num_prompts_and_cycles_bound_the_run() -> None:
    s = phases.build(50, 2.0, phase_seconds=10, vocab=1000)
    assert len(s.requests) == len(s.offsets) == 50
    assert s.windows[-1].end == s.offsets[-1] < s.windows[-1].start + 10        # cut at its last arrival
    assert all(w.end == w.start + 10 for w in s.windows[:-1])
    one_cycle = phases.phase_times(None, 2.0, phase_seconds=10)[0]
    assert len(phases.phase_times(10_000, 2.0, phase_seconds=10, cycles=1)[0]) == len(one_cycle)
    long = phases.phase_times(len(one_cycle) + 5, 2.0, phase_seconds=10)
    assert len(long[0]) == len(one_cycle) + 5 and long[2][-1].phase == "prefill-heavy"   # into cycle 2
    with pytest.raises(ValueError):
        phases.phase_times(10, math.inf)
    with pytest.raises(ValueError):
        phases.parse_multipliers("1,3")


# ---- requests -------------------------------------------------------------------------------
def test_each_phase_draws_its_workload_and_names_itself() -> None:
    s = phases.build(None, 1.0, seed=2, phase_seconds=6, vocab=5000)
    by_time = [next(w.phase for w in s.windows if w.start <= t < w.end) for t in s.offsets]
    assert [r.extra["phase"] for r in s.requests] == by_time
    limits = {"prefill-heavy": ((2000, 4000), (100, 300)), "shared-prefix": ((2100, 2500), (100, 500)),
              "decode-heavy": ((200, 800), (500, 1500))}
    for r in s.requests:
        (lo, hi), (olo, ohi) = limits[r.extra["phase"]]
        assert r.token_ids is not None and lo <= r.prompt_len == len(r.token_ids) <= hi and olo <= r.output_len <= ohi
        assert ("prefix" in r.extra) == (r.extra["phase"] == "shared-prefix")
    shared = [r for r in s.requests if r.extra["phase"] == "shared-prefix"]
    assert shared and all(0 <= r.extra["prefix"] < 16 for r in shared)
    first = {}
    for r in shared:      # one prefix, one system prompt
        assert r.token_ids is not None
        assert first.setdefault(r.extra["prefix"], r.token_ids[:SP_PREFIX]) == r.token_ids[:SP_PREFIX]


def test_deterministic_for_a_seed_and_a_variant() -> None:
    a, b = (phases.build(40, 2.0, seed=3, phase_seconds=5, vocab=1000, variant=1) for _ in range(2))
    assert a.offsets == b.offsets and [r.token_ids for r in a.requests] == [r.token_ids for r in b.requests]
    c = phases.build(40, 2.0, seed=4, phase_seconds=5, vocab=1000, variant=1)
    assert c.offsets != a.offsets


def test_variants_keep_times_lengths_and_prefixes_and_change_the_rest() -> None:
    a = phases.build(60, 2.0, seed=3, phase_seconds=10, vocab=50000)
    b = phases.build(60, 2.0, seed=3, phase_seconds=10, vocab=50000, variant=2)
    assert a.offsets == b.offsets and a.windows == b.windows
    for x, y in zip(a.requests, b.requests):
        assert (x.prompt_len, x.output_len, x.extra) == (y.prompt_len, y.output_len, y.extra)
        assert x.token_ids is not None and y.token_ids is not None
        keep = SP_PREFIX if x.extra["phase"] == "shared-prefix" else 0
        assert x.token_ids[:keep] == y.token_ids[:keep] and x.token_ids[keep:] != y.token_ids[keep:]
    assert {r.extra["phase"] for r in a.requests} == {"prefill-heavy", "shared-prefix"}


# ---- per-phase metrics ----------------------------------------------------------------------
def _rec(i: int, send: float, ttft: float, gap: float, n: int = 5, code: str = "OK") -> RequestRecord:
    times = [send + ttft + k * gap for k in range(n)] if code == "OK" else []
    return RequestRecord(index=i, send_time=send, msg_times=times, msg_tokens=[1] * len(times),
                         end_time=times[-1] if times else send + 0.1, code=code, output_tokens=len(times))


def _hand_schedule() -> tuple[Schedule, list[RequestRecord]]:
    """Windows: prefill-heavy 0-10, shared-prefix 10-20, decode-heavy 20-30, prefill-heavy 30-35 (cut)."""
    windows = [Window("prefill-heavy", 0, 10, 1.0), Window("shared-prefix", 10, 20, 3.0),
               Window("decode-heavy", 20, 30, 2.0), Window("prefill-heavy", 30, 35, 1.0)]
    names = ["prefill-heavy", "prefill-heavy", "shared-prefix", "shared-prefix", "decode-heavy", "prefill-heavy"]
    offsets = [1.0, 5.0, 12.0, 15.0, 22.0, 35.0]
    reqs = [BenchRequest(4, 5, token_ids=[1, 2, 3, 4], extra={"phase": n}) for n in names]
    records = [_rec(0, 1.0, 0.5, 0.010),               # meets ttft 1,000 ms and tpot 20 ms
               _rec(1, 5.0, 2.0, 0.010),               # ttft 2 s: misses
               _rec(2, 12.0, 0.2, 0.010),              # meets
               _rec(3, 15.0, 0.2, 0.010, code="UNAVAILABLE"),   # failed: misses
               _rec(4, 22.0, 0.2, 0.030),              # tpot 30 ms: misses
               _rec(5, 35.0, 0.1, 0.010)]              # meets
    return Schedule(reqs, offsets, windows), records


def test_phase_metrics_split_the_run_by_phase() -> None:
    sched, records = _hand_schedule()
    slo = {"ttft": 1000.0, "tpot": 20.0}
    whole = compute_metrics(records, 40.0, slo=slo)
    assert whole["slo_attainment"] == approx(3 / 6)
    per = phases.phase_metrics(records, sched, slo=slo)
    assert list(per) == ["prefill-heavy", "shared-prefix", "decode-heavy"]
    pre, sp, dec = per["prefill-heavy"], per["shared-prefix"], per["decode-heavy"]
    assert set(pre) == set(whole) | {"request_rate", "num_windows"}        # the run's metric keys
    assert (pre["num_requests"], pre["completed"], pre["duration"], pre["num_windows"]) == (3, 3, 15.0, 2)
    assert pre["slo_attainment"] == approx(2 / 3) and pre["request_goodput"] == approx(2 / 15)
    assert pre["request_throughput"] == approx(3 / 15) and pre["request_rate"] == 1.0
    assert pre["mean_ttft_ms"] == approx((500 + 2000 + 100) / 3)
    assert (sp["num_requests"], sp["completed"], sp["failed"], sp["duration"]) == (2, 1, 1, 10.0)
    assert sp["slo_attainment"] == approx(0.5) and sp["request_goodput"] == approx(0.1)
    assert dec["slo_attainment"] == 0.0 and dec["mean_tpot_ms"] == approx(30.0) and dec["request_rate"] == 2.0
    assert phases.attainment(per, 0.5) == {"prefill-heavy": {"slo_attainment": approx(2 / 3), "holds": True},
                                           "shared-prefix": {"slo_attainment": 0.5, "holds": True},
                                           "decode-heavy": {"slo_attainment": 0.0, "holds": False}}
    lines = phases.format_phases(per).splitlines()
    assert len(lines) == 3 and lines[1].startswith("phase shared-prefix") and "SLO attainment 50.0%" in lines[1]


def test_phases_without_requests_are_left_out_and_capacity_keeps_each_phase() -> None:
    sched, records = _hand_schedule()
    per = phases.phase_metrics(records[:2], sched, slo={"ttft": 1000.0, "itl_p99": 50.0})
    assert list(per) == ["prefill-heavy"] and per["prefill-heavy"]["itl_p99_ok"]
    res = {**compute_metrics(records, 40.0, slo={"ttft": 1000.0}),
           "phases": phases.phase_metrics(records, sched, slo={"ttft": 1000.0})}
    held, info = compare.capacity_point(res, 0.6)      # the whole run: 4 of 6 within 1 s
    assert held and info["slo_attainment"] == approx(4 / 6)
    assert info["phases"]["shared-prefix"] == {"slo_attainment": 0.5, "holds": False}
    assert info["phases"]["decode-heavy"]["holds"]
    assert schedule.summary(sched)["phases"] == {"prefill-heavy": 3, "shared-prefix": 2, "decode-heavy": 1}


# ---- CLI --------------------------------------------------------------------------------------
INFO = {"vocab_size": 1000, "max_model_len": 8192}


def _args(*flags: str):
    return build_parser().parse_args(["bench", "serve", "--dataset", "phases", *flags])


def test_cli_parses_the_phase_flags_and_builds_the_workload() -> None:
    args = _args("--phase-seconds", "5", "--phase-rates", "1,3,2", "--request-rate", "2", "--num-prompts", "40")
    assert (args.phase_seconds, args.phase_rates, args.phase_cycles) == (5.0, "1,3,2", None)
    work = runner.workload(args, INFO, runner.opts_from_args(args))
    first, run1 = work(0, 2.0), work(1, 2.0)
    assert len(run1.requests) == 40 and [w.start for w in run1.windows][:2] == [0.0, 5.0]
    assert run1.windows[1].rate == 6.0 and all(t < 1000 for r in run1.requests for t in r.token_ids or [])
    assert first.offsets == run1.offsets and first.requests[0].token_ids != run1.requests[0].token_ids
    same = runner.workload(_args("--same-prompts", "--num-prompts", "10"), INFO, runner.opts_from_args(args))
    assert same(0, 2.0).requests == same(3, 2.0).requests
    cmp = build_parser().parse_args(["bench", "compare", "--targets", "a=h:1,b=h:2", "--dataset", "phases",
                                     "--capacity", "--capacity-range", "1:4", "--phase-cycles", "2"])
    assert cmp.phase_cycles == 2 and cmp.dataset == "phases"


def test_cli_refuses_what_phases_cannot_run() -> None:
    with pytest.raises(SystemExit, match="finite"):
        runner.check_phases(_args(), [2.0, math.inf])
    runner.check_phases(_args(), [1.0, 2.0])
    for flags in (["--input-len", "100:200"], ["--normalize-arrivals"], ["--phase-rates", "1,0,2"]):
        args = _args(*flags)
        with pytest.raises(SystemExit):
            runner.check_phases(args, [])
        with pytest.raises(ValueError):
            runner.workload(args, INFO, runner.opts_from_args(args))
    runner.check_phases(build_parser().parse_args(["bench", "serve", "--input-len", "5"]), [math.inf])   # not phases


def test_other_datasets_keep_their_arrival_process() -> None:
    args = build_parser().parse_args(["bench", "serve", "--dataset", "random", "--num-prompts", "8",
                                      "--burstiness", "2", "--seed", "5"])
    s = runner.workload(args, INFO, runner.opts_from_args(args))(1, 4.0)
    assert s.offsets == list(arrivals.arrival_times(8, 4.0, 2.0, seed=5)) and not s.windows


# ---- one short run ----------------------------------------------------------------------------
class TwoTokens(router_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        yield router_pb2.GenerateResponse(token_ids=[1])
        yield router_pb2.GenerateResponse(token_ids=[2], finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def server_address():
    with serve(TwoTokens()) as address:
        yield address


def test_a_phased_run_reports_each_phase(server_address: str) -> None:
    small = {"prefill-heavy": {"input_len": (8, 16), "output_len": (2, 2)},
             "shared-prefix": {"num_prefixes": 2, "prefix_len": 8, "input_len": (2, 4), "output_len": (2, 2)},
             "decode-heavy": {"input_len": (2, 4), "output_len": (2, 2)}}
    sched = phases.build(None, 20.0, phase_seconds=0.3, vocab=1000, workloads=small)
    opts = runner.RunOptions(slo={"ttft": 5000.0}, disable_tqdm=True, quiet=True, request_timeout=30)
    res, _ = runner.run_point(server_address, sched, 20.0, None, opts, variant=1)
    assert res["completed"] == len(sched.requests) and res["slo_attainment"] == 1.0
    assert list(res["phases"]) == list(phases.PHASES)
    assert sum(p["num_requests"] for p in res["phases"].values()) == len(sched.requests)
    assert [p["request_rate"] for p in res["phases"].values()] == [20.0, 60.0, 40.0]
    assert all(p["slo_attainment"] == 1.0 and p["duration"] == approx(0.3) for p in res["phases"].values())
