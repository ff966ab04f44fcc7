"""Admission control (pdserve.router.admission): the decision on hand-computed snapshots, the
gate's count of waiting requests and its metrics, and what a refusal looks like on each door
(gRPC trailing metadata, HTTP 429 with Retry-After)."""
from __future__ import annotations

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
    decide,
)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.pd_policy import PdConfig
from pdserve.router.settings import RouterSettings

SLO = 1000.0        # ms, the default TTFT objective
OFF = AdmissionConfig(slo_multiple=0)


def _decide(places: list[tuple[int, float]], own: int, reported: int, cfg: AdmissionConfig, slo: float = SLO):
    """decide over (Q, R) per place."""
    return decide([q for q, _ in places], [r for _, r in places], own, reported, cfg, slo)


# ---- the decision -------------------------------------------------------------------------

def test_nothing_up_or_every_bound_off_admits():
    assert _decide([], 100, 100, AdmissionConfig(max_waiting_requests=1)).reason == ADMIT
    huge = [(10**9, 1.0)]
    assert _decide(huge, 10**6, 10**6, OFF).reason == ADMIT
    assert not OFF.enabled and AdmissionConfig().enabled      # the SLO bound is on by default


def test_slo_bound_refuses_when_even_the_least_busy_place_waits_too_long():
    # waits 9000/2000 = 4.5 s and 12000/3000 = 4.0 s; 4.0 s > 2 x 1 s -> refused,
    # Retry-After = ceil(4.0 - 2.0) = 2 s
    v = _decide([(9000, 2000.0), (12000, 3000.0)], 0, 0, AdmissionConfig())
    assert (v.reason, v.wait_ms, v.retry_after_s) == (SLO_TTFT, 4000.0, 2)
    assert "4.0 s" in v.detail and "2 x" in v.detail
    # one place with a short queue (1000/1000 = 1 s <= 2 s) is enough to admit
    v = _decide([(9000, 2000.0), (1000, 1000.0)], 0, 0, AdmissionConfig())
    assert (v.reason, v.wait_ms, v.retry_after_s) == (ADMIT, 1000.0, 0)


def test_slo_bound_is_strict_and_follows_the_multiple_and_the_objective():
    at = [(2000, 1000.0)]        # wait 2 s == 2 x 1 s: not over
    assert _decide(at, 0, 0, AdmissionConfig()).admitted
    assert _decide(at, 0, 0, AdmissionConfig(slo_multiple=1.5)).reason == SLO_TTFT   # 2 s > 1.5 s
    assert _decide(at, 0, 0, AdmissionConfig(slo_multiple=1.5), 2000.0).admitted          # 2 s <= 3 s
    assert _decide(at, 0, 0, AdmissionConfig(slo_multiple=0), 1.0).admitted                # off


def test_unmeasured_rates_take_the_mean_of_the_measured_ones_else_the_default():
    # R = [0, 1000] -> the unmeasured one runs at 1000: waits 4 s, 4 s -> refused, retry 2 s
    v = _decide([(4000, 0.0), (4000, 1000.0)], 0, 0, AdmissionConfig())
    assert (v.reason, v.wait_ms, v.retry_after_s) == (SLO_TTFT, 4000.0, 2)
    # none measured: DEFAULT_PREFILL_TOKENS_PER_S = 8000 -> 20000 tokens wait 2.5 s; retry ceil(0.5) = 1
    v = _decide([(20000, 0.0)], 0, 0, AdmissionConfig())
    assert (v.reason, v.wait_ms, v.retry_after_s) == (SLO_TTFT, 2500.0, 1)


def test_queued_tokens_bound_needs_every_place_at_or_over_it():
    cfg = AdmissionConfig(max_queued_prompt_tokens=4000, slo_multiple=0)
    assert _decide([(10000, 2000.0), (3000, 1000.0)], 0, 0, cfg).admitted   # 3000 < 4000
    # min Q = 9000 >= 4000; drains (10000-4000)/2000 = 3 s and (9000-4000)/1000 = 5 s -> retry 3 s
    v = _decide([(10000, 2000.0), (9000, 1000.0)], 0, 0, cfg)
    assert (v.reason, v.retry_after_s) == (QUEUED_TOKENS, 3)
    assert "9000" in v.detail and "4000" in v.detail
    # exactly at the bound is over it; nothing to drain below it -> the least Retry-After, 1 s
    v = _decide([(4000, 1000.0)], 0, 0, cfg)
    assert (v.reason, v.retry_after_s) == (QUEUED_TOKENS, 1)


def test_waiting_requests_bound_is_per_place_and_counts_the_larger_view():
    cfg = AdmissionConfig(max_waiting_requests=4)           # 2 places -> L = 8
    places = [(20000, 1000.0), (16000, 2000.0)]      # waits 20 s, 8 s -> min 8 s
    # W = max(7, 12) = 12 >= 8 -> refused; retry = 8 s x (12 - 8 + 1) / 12 = 3.33 -> 4 s
    v = _decide(places, 7, 12, cfg)
    assert (v.reason, v.wait_ms, v.retry_after_s) == (WAITING_REQUESTS, 8000.0, 4)
    assert "12 requests" in v.detail and "4 per worker x 2" in v.detail
    # own 8 alone reaches it (the workers' stats may not show them yet)
    assert _decide(places, 8, 0, cfg).reason == WAITING_REQUESTS
    # W = 7 < 8: this bound holds, the next rule decides (8 s > 2 x 1 s: the SLO bound; retry 6 s)
    v = _decide(places, 7, 7, cfg)
    assert (v.reason, v.retry_after_s) == (SLO_TTFT, 6)
    assert _decide(places, 7, 7, AdmissionConfig(max_waiting_requests=4, slo_multiple=0)).admitted


def test_retry_after_is_clamped():
    v = _decide([(10**6, 1000.0)], 0, 0, AdmissionConfig())   # 1000 s of queue
    assert v.reason == SLO_TTFT and v.retry_after_s == MAX_RETRY_AFTER_S


def test_config_refuses_negative_bounds():
    for kw in ({"max_queued_prompt_tokens": -1}, {"max_waiting_requests": -1}, {"slo_multiple": -0.5}):
        with pytest.raises(ValueError):
            AdmissionConfig(**kw)


# ---- the gate -----------------------------------------------------------------------------

@dataclass
class _Worker:
    key: str
    queued_prompt_tokens: int = 0
    prefill_tokens_per_s: float = 1000.0
    stats: WorkerStats | None = None

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
    drains a long queue at the higher rate: 15,000 tokens wait 1.5 s, not 30 s."""
    import pdserve.router.admission as admission
    clock = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    w = _Worker("p0", 15_000, 10_000.0)
    gate, _ = _gate(_Registry([w], []))
    gate.admit("Generate").close()
    w.prefill_tokens_per_s = 500.0
    clock[0] += 1.0                         # past PEAK_REFRESH_S: the rates are looked at again
    gate.admit("Generate").close()          # 1.5 s <= 2 x 1 s
    w.queued_prompt_tokens = 25_000         # 2.5 s at the peak rate: refused; retry ceil(0.5) = 1 s
    with pytest.raises(Overloaded) as e:
        gate.admit("Generate")
    assert e.value.reason == SLO_TTFT and e.value.retry_after_s == 1
    fresh = _Worker("p1", 15_000, 500.0)   # no higher figure seen: its own
    gate, _ = _gate(_Registry([fresh], []))
    with pytest.raises(Overloaded):
        gate.admit("Generate")


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
