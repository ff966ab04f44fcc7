"""Admission control (pdserve.router.admission): the decision on hand-computed snapshots, the
gate's count of waiting requests and its metrics, and what a refusal looks like on each door
(gRPC trailing metadata, HTTP 429 with Retry-After)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest

from pdserve.common.worker_types import WorkerStats
from pdserve.router.admission import (
    ADMIT,
    MAX_RETRY_AFTER_S,
    QUEUED_TOKENS,
    SLO_TTFT,
    WAITING_REQUESTS,
    AdmissionConfig,
    AdmissionGate,
    Overloaded,
    Place,
    decide,
    kept_rate,
    prefill_ms,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pd_policy import PdConfig
from pdserve.router.settings import RouterSettings

SLO = 1000.0        # ms, the default TTFT objective
OFF = AdmissionConfig(slo_multiple=0)


def _decide(places: list[tuple], prompt: int, own: int, reported: int, cfg: AdmissionConfig, slo: float = SLO):
    """decide over (Q, R[, t, B]) per place."""
    return decide([Place(*p) for p in places], prompt, own, reported, cfg, slo)


# ---- the decision -------------------------------------------------------------------------

def test_nothing_up_or_every_bound_off_admits():
    assert _decide([], 100, 100, 100, AdmissionConfig(max_waiting_requests=1)).reason == ADMIT
    huge = [(10**9, 1.0)]
    assert _decide(huge, 10**6, 10**6, 10**6, OFF).reason == ADMIT
    assert not OFF.enabled and AdmissionConfig().enabled      # the SLO bound is on by default
    assert AdmissionConfig().slo_multiple == 1.0              # at the objective itself


def test_prefill_time_counts_a_decode_step_per_prefill_step():
    # T(n) = 1000 n / R + (ceil(n / B) + 1) t: the step in flight, then the prefill's
    assert prefill_ms(Place(0, 2000.0), 1200) == 600.0                       # no decode rows
    assert prefill_ms(Place(0, 2000.0, 100.0, 512), 1200) == 600.0 + 4 * 100.0   # 3 steps of 512 + 1
    assert prefill_ms(Place(0, 2000.0, 100.0, 0), 1200) == 800.0             # B unknown: one step + 1
    assert prefill_ms(Place(0, 2000.0, 100.0, 512), 0) == 0.0


def test_slo_bound_refuses_when_every_place_would_miss_the_objective():
    # U = 1000: ttft 10000/2000 = 5.0 s (bound max(1, 0.5 + 0.25) = 1 s), 13000/3000 = 4.33 s
    # (bound max(1, 0.33 + 0.25) = 1 s) -> refused; Retry-After = ceil(4.33 - 1) = 4 s
    v = _decide([(9000, 2000.0), (12000, 3000.0)], 1000, 0, 0, AdmissionConfig())
    assert (v.reason, round(v.estimate_ms, 1), v.retry_after_s) == (SLO_TTFT, 4333.3, 4)
    assert "4.33 s" in v.detail and "12000 prompt tokens" in v.detail and "1 x the TTFT objective of 1 s" in v.detail
    # one place where it fits (500 queued + 400 own at 1000/s = 0.9 s <= 1 s) is enough to admit
    v = _decide([(9000, 2000.0), (500, 1000.0)], 400, 0, 0, AdmissionConfig())
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (ADMIT, 900.0, 0)


def test_the_requests_own_prompt_counts():
    place = [(600, 1000.0)]                      # 0.6 s of queue
    assert _decide(place, 300, 0, 0, AdmissionConfig()).admitted                   # 0.9 s <= 1 s
    v = _decide(place, 500, 0, 0, AdmissionConfig())                               # 1.1 s > 1 s
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (SLO_TTFT, 1100.0, 1)     # ceil(0.1)
    assert _decide(place, 0, 0, 0, AdmissionConfig()).admitted      # U not given: the queue alone
    assert _decide([(0, 1000.0)], 10**6, 0, 0, AdmissionConfig()).admitted   # nothing queued: never refused


def test_a_long_prompt_may_still_wait_a_quarter_of_its_objective():
    # U = 3000 at 1000/s: 3 s of its own, over the objective whatever happens; bound = 3 + 0.25 s
    assert _decide([(200, 1000.0)], 3000, 0, 0, AdmissionConfig()).admitted          # 3.2 s <= 3.25 s
    v = _decide([(400, 1000.0)], 3000, 0, 0, AdmissionConfig())                      # 3.4 s > 3.25 s
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (SLO_TTFT, 3400.0, 1)
    # U = 800 (0.8 s, over 3/4 of the objective): bound max(1, 0.8 + 0.25) = 1.05 s
    assert _decide([(250, 1000.0)], 800, 0, 0, AdmissionConfig()).admitted           # 1.05 s
    assert not _decide([(300, 1000.0)], 800, 0, 0, AdmissionConfig()).admitted       # 1.1 s


def test_decode_rows_slow_the_queue_of_a_worker_that_decodes():
    # 1000 queued + 200 own at 2000/s, steps of 512 with 100 ms of decode rows each:
    # 600 + (3 + 1) x 100 = 1000 ms <= max(1000, T(200) + 250 = 100 + 200 + 250) -> admitted
    assert _decide([(1000, 2000.0, 100.0, 512)], 200, 0, 0, AdmissionConfig()).estimate_ms == 1000.0
    v = _decide([(1000, 2000.0, 150.0, 512)], 200, 0, 0, AdmissionConfig())     # 600 + 600 = 1200 ms
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (SLO_TTFT, 1200.0, 1)
    assert _decide([(1000, 2000.0, 150.0, 0)], 200, 0, 0, AdmissionConfig()).admitted   # 1 step + 1: 900 ms


def test_slo_bound_is_strict_and_follows_the_multiple_and_the_objective():
    at = [(600, 1000.0)]        # 600 queued + 400 own: 1 s == 1 x 1 s: not over
    assert _decide(at, 400, 0, 0, AdmissionConfig()).admitted
    over = [(1500, 1000.0)]     # 1.9 s
    assert _decide(over, 400, 0, 0, AdmissionConfig()).reason == SLO_TTFT
    assert _decide(over, 400, 0, 0, AdmissionConfig(slo_multiple=2)).admitted           # 1.9 s <= 2 s
    assert _decide(over, 400, 0, 0, AdmissionConfig(), 2000.0).admitted                 # 1.9 s <= 2 s
    assert _decide(over, 400, 0, 0, AdmissionConfig(slo_multiple=0.5), 4000.0).admitted
    assert _decide(over, 400, 0, 0, AdmissionConfig(slo_multiple=0), 1.0).admitted      # off


def test_unmeasured_rates_take_the_mean_of_the_measured_ones_else_the_default():
    # R = [0, 1000] -> the unmeasured one runs at 1000: both 4 s > 1 s -> refused, retry 3 s
    v = _decide([(4000, 0.0), (4000, 1000.0)], 0, 0, 0, AdmissionConfig())
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (SLO_TTFT, 4000.0, 3)
    # none measured: DEFAULT_PREFILL_TOKENS_PER_S = 8000 -> 20000 tokens wait 2.5 s; retry ceil(1.5) = 2
    v = _decide([(20000, 0.0)], 0, 0, 0, AdmissionConfig())
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (SLO_TTFT, 2500.0, 2)


def test_queued_tokens_bound_needs_every_place_at_or_over_it():
    cfg = AdmissionConfig(max_queued_prompt_tokens=4000, slo_multiple=0)
    assert _decide([(10000, 2000.0), (3000, 1000.0)], 100, 0, 0, cfg).admitted   # 3000 < 4000
    # min Q = 9000 >= 4000; drains (10000-4000)/2000 = 3 s and (9000-4000)/1000 = 5 s -> retry 3 s
    v = _decide([(10000, 2000.0), (9000, 1000.0)], 100, 0, 0, cfg)
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (QUEUED_TOKENS, 5000.0, 3)
    assert "9000" in v.detail and "4000" in v.detail
    # exactly at the bound is over it; nothing to drain below it -> the least Retry-After, 1 s
    v = _decide([(4000, 1000.0)], 100, 0, 0, cfg)
    assert (v.reason, v.retry_after_s) == (QUEUED_TOKENS, 1)


def test_waiting_requests_bound_is_per_place_and_counts_the_larger_view():
    cfg = AdmissionConfig(max_waiting_requests=4)           # 2 places -> L = 8
    places = [(20000, 1000.0), (16000, 2000.0)]      # waits 20 s, 8 s -> min 8 s
    # W = max(7, 12) = 12 >= 8 -> refused; retry = 8 s x (12 - 8 + 1) / 12 = 3.33 -> 4 s
    v = _decide(places, 0, 7, 12, cfg)
    assert (v.reason, v.estimate_ms, v.retry_after_s) == (WAITING_REQUESTS, 8000.0, 4)
    assert "12 requests" in v.detail and "4 per worker x 2" in v.detail
    # own 8 alone reaches it (the workers' stats may not show them yet)
    assert _decide(places, 0, 8, 0, cfg).reason == WAITING_REQUESTS
    # W = 7 < 8: this bound holds, the next rule decides (8 s > 1 s: the SLO bound; retry 7 s)
    v = _decide(places, 0, 7, 7, cfg)
    assert (v.reason, v.retry_after_s) == (SLO_TTFT, 7)
    assert _decide(places, 0, 7, 7, AdmissionConfig(max_waiting_requests=4, slo_multiple=0)).admitted


def test_retry_after_is_clamped():
    v = _decide([(10**6, 1000.0)], 0, 0, 0, AdmissionConfig())   # 1000 s of queue
    assert v.reason == SLO_TTFT and v.retry_after_s == MAX_RETRY_AFTER_S


def test_config_refuses_negative_bounds():
    for kw in ({"max_queued_prompt_tokens": -1}, {"max_waiting_requests": -1}, {"slo_multiple": -0.5}):
        with pytest.raises(ValueError):
            AdmissionConfig(**kw)


def test_kept_rate_falls_only_while_busy_and_rises_at_once():
    assert kept_rate(0.0, 300.0, True, 1.0) == 300.0                  # first figure
    assert kept_rate(1000.0, 1200.0, True, 1.0) == 1200.0             # a higher one: at once
    assert kept_rate(1000.0, 50.0, False, 600.0) == 1000.0            # idle: kept (a small step's figure)
    assert kept_rate(1000.0, 500.0, True, 30.0) == pytest.approx(1000.0 * 0.5 ** (1 / 30))   # 1 s counted
    kept = 1000.0
    for _ in range(30):                                               # 30 busy seconds: halved
        kept = kept_rate(kept, 400.0, True, 1.0)
    assert kept == pytest.approx(500.0)
    for _ in range(60):                                               # then the reported figure
        kept = kept_rate(kept, 400.0, True, 1.0)
    assert kept == 400.0


# ---- the gate -----------------------------------------------------------------------------

@dataclass
class _Worker:
    key: str
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 1000.0
    stats: WorkerStats | None = None
    decoding: int = 0

    @property
    def worker_id(self) -> str:
        return f"id-{self.key}"


class _Registry:
    def __init__(self, prefill: list[_Worker], decode: list[_Worker]) -> None:
        self.prefill, self.decode = prefill, decode
        self.clients = {w.key: w for w in [*prefill, *decode]}

    def prefill_workers(self) -> list[_Worker]:
        return self.prefill

    def decode_workers(self) -> list[_Worker]:
        return self.decode


def _gate(registry: _Registry, mode: str = "adaptive", **bounds) -> tuple[AdmissionGate, RouterMetrics]:
    metrics = RouterMetrics()
    settings = RouterSettings(router_id="r", pd=PdConfig(mode=mode), admission=AdmissionConfig(**bounds))
    return AdmissionGate(registry, settings, metrics), metrics   # type: ignore[arg-type]


def _sample(metrics: RouterMetrics, name: str, **labels) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_gate_counts_waiting_requests_until_their_first_token_and_refuses_beyond():
    gate, metrics = _gate(_Registry([_Worker("p0")], [_Worker("d0")]), max_waiting_requests=2)
    first, second = gate.admit("Generate"), gate.admit("Generate")
    assert gate.waiting == 2
    with pytest.raises(Overloaded) as e:
        gate.admit("Completions")
    assert e.value.reason == WAITING_REQUESTS and e.value.retry_after_s == 1
    assert e.value.code.name == "RESOURCE_EXHAUSTED" and "retry after 1 s" in e.value.message
    assert _sample(metrics, "pdserve_router_requests_refused_total", reason=WAITING_REQUESTS) == 1
    assert _sample(metrics, "pdserve_router_requests_total", method="Completions", status="RESOURCE_EXHAUSTED") == 1
    assert _sample(metrics, "pdserve_router_requests_refused_total", reason=SLO_TTFT) == 0   # present from the start
    first.close()
    first.close()                   # idempotent: the first token, then the request's end
    assert gate.waiting == 1
    gate.admit("Generate").close()
    second.close()
    assert gate.waiting == 0


def test_gate_reads_the_places_that_could_prefill():
    busy, idle = _Worker("p0", 50_000), _Worker("d0", 0)
    gate, _ = _gate(_Registry([busy], [idle]))                  # prefill-capable workers are the places
    with pytest.raises(Overloaded) as e:
        gate.admit("Generate")
    assert e.value.reason == SLO_TTFT and e.value.retry_after_s == 30   # 50 s of queue, clamped
    gate, _ = _gate(_Registry([busy], [idle]), mode="never")    # always local: the decode workers
    gate.admit("Generate").close()
    gate, _ = _gate(_Registry([], [idle]))                      # no prefill-capable worker: the decode ones
    gate.admit("Generate").close()


def test_gate_estimates_with_the_highest_rate_each_worker_reported(monkeypatch):
    """A worker that once prefilled at 10,000 tokens/s and now reports 500 (short prompts since)
    drains a long queue at about the higher rate: 4,500 tokens wait ~0.5 s, not 9 s; while it
    stays busy the kept figure falls toward what it reports (30 busy seconds: halved)."""
    import pdserve.router.admission as admission
    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    w = _Worker("p0", 4_500, 10_000.0)
    gate, _ = _gate(_Registry([w], []))
    gate.admit("Generate").close()
    w.prefill_tokens_per_s = 500.0
    clock[0] += 1.0                         # past PEAK_REFRESH_S: the rates are looked at again
    gate.admit("Generate", 1000).close()    # (4500 + 1000) / 9772 = 0.56 s <= 1 s
    w.queued_prompt_tokens = 5_500
    gate.admit("Generate").close()          # 0.56 s
    for _ in range(29):                     # 29 more busy seconds: 10,000 x 0.5^(30/30) = 5000 /s
        clock[0] += 1.0
        with contextlib.suppress(Overloaded):
            gate.admit("Generate").close()
    with pytest.raises(Overloaded) as e:    # 5500 / 5000 = 1.1 s > 1 s
        gate.admit("Generate")
    assert e.value.reason == SLO_TTFT and e.value.retry_after_s == 1 and "1.10 s" in e.value.message
    fresh = _Worker("p1", 4_500, 500.0)     # no higher figure seen: its own (9 s)
    gate, _ = _gate(_Registry([fresh], []))
    with pytest.raises(Overloaded):
        gate.admit("Generate")


def test_gate_counts_the_prompt_and_the_requests_own_objective():
    w = _Worker("p0", 600, 1000.0)          # 0.6 s of queue
    gate, metrics = _gate(_Registry([w], []))
    gate.admit("Generate", 300).close()                         # 0.9 s <= 1 s
    with pytest.raises(Overloaded):
        gate.admit("Generate", 500)                             # 1.1 s > 1 s
    with pytest.raises(Overloaded):
        gate.admit("Generate", 300, slo_ttft_ms=800.0)          # tighter: 0.9 s > max(0.8, 0.3 + 0.2)
    gate.admit("Generate", 300, slo_ttft_ms=5000.0).close()     # looser: the router's 1 s counts
    assert _sample(metrics, "pdserve_router_requests_refused_total", reason=SLO_TTFT) == 2
    w.queued_prompt_tokens = 0
    gate.admit("Generate", 10**6).close()                       # nothing queued: admitted
    assert gate.waiting == 0


def test_gate_counts_decode_rows_on_a_worker_that_decodes():
    # 600 queued + 300 own at 1000/s in steps of 512, 200 ms of decode rows a step: 0.9 + (2 + 1) x 0.2 = 1.5 s
    stats = WorkerStats(num_running=2, decode_step_ms=200.0, max_num_batched_tokens=512)
    gate, _ = _gate(_Registry([_Worker("b0", 600, 1000.0, stats)], []))
    with pytest.raises(Overloaded):
        gate.admit("Generate", 300)
    idle = WorkerStats(num_running=0, decode_step_ms=200.0, max_num_batched_tokens=512)
    gate, _ = _gate(_Registry([_Worker("b0", 600, 1000.0, idle)], []))
    gate.admit("Generate", 300).close()                         # not decoding: 0.9 s
    gate, _ = _gate(_Registry([_Worker("b0", 600, 1000.0, idle, decoding=1)], []))
    with pytest.raises(Overloaded):                             # this router's request decodes there
        gate.admit("Generate", 300)


def test_gate_counts_other_replicas_waiting_requests_from_the_stats():
    w = _Worker("p0", stats=WorkerStats(num_waiting=3))
    gate, _ = _gate(_Registry([w], []), max_waiting_requests=3)
    with pytest.raises(Overloaded):
        gate.admit("Generate")
    assert gate.waiting == 0


# ---- on the wire --------------------------------------------------------------------------

def test_a_refusal_carries_its_retry_after_on_both_doors():
    from pdserve.router.admission import Verdict
    from pdserve.router.openai_api.errors import from_exception
    err = Overloaded(Verdict(SLO_TTFT, 5000.0, 3, "queue"))
    assert dict(err.trailing_metadata()) == {"retry-after": "3", "grpc-retry-pushback-ms": "3000"}
    api = from_exception(err)
    assert (api.status, api.type, api.code) == (429, "rate_limit_error", "resource_exhausted")
    assert api.headers() == {"retry-after": "3"}
    from pdserve.common.grpc_utils import ResourceExhausted, Unavailable
    assert ResourceExhausted("no room").trailing_metadata() == ()          # e.g. a Reserve refused for room
    assert from_exception(Unavailable("draining")).headers() == {"retry-after": "1"}
