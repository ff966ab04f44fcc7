"""Metrics of the prefill-placement policy (pdserve.router.pd_policy): what it decided, why, and how its
estimates compared with what then happened.

Decisions by kind and reason, the chosen option's predicted TTFT / TPOT, each stream's observed
TPOT, and observed / predicted error ratios (only when the request went where the policy decided).
Written on the router's event loop only (OneWriterHistogram: no lock).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from pdserve.common.serving.metrics import OneWriterHistogram

ROUTES = ("local", "remote")
_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_RATIO = (0.25, 0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2, 3, 5, 10)


class PdMetrics:
    def __init__(self, r: CollectorRegistry) -> None:
        self.decisions = Counter("pdserve_router_pd_decisions", "Prefill placements by kind and deciding rule",
                                 ["kind", "reason"], registry=r)
        self.predicted_ttft = OneWriterHistogram("pdserve_router_pd_predicted_ttft_seconds", "Estimated TTFT of "
                                                 "the chosen placement", _LATENCY, r, ("route",))
        self.predicted_tpot = OneWriterHistogram("pdserve_router_pd_predicted_tpot_seconds", "Estimated TPOT of "
                                                 "the chosen placement", _LATENCY, r, ("route",))
        self.observed_tpot = OneWriterHistogram("pdserve_router_pd_observed_tpot_seconds", "TPOT of each stream "
                                                "((last - first token) / (tokens - 1))", _LATENCY, r, ("route",))
        self.ttft_ratio = OneWriterHistogram("pdserve_router_pd_ttft_error_ratio", "Observed / estimated TTFT",
                                             _RATIO, r, ("route",))
        self.tpot_ratio = OneWriterHistogram("pdserve_router_pd_tpot_error_ratio", "Observed / estimated TPOT",
                                             _RATIO, r, ("route",))
        for route in ROUTES:
            for h in (self.predicted_ttft, self.predicted_tpot, self.observed_tpot, self.ttft_ratio,
                      self.tpot_ratio):
                h.labels(route)

    def decided(self, kind: str, reason: str, ttft_ms: float, tpot_ms: float) -> None:
        self.decisions.labels(kind, reason).inc()
        self.predicted_ttft.labels(kind).observe(ttft_ms / 1000.0)
        self.predicted_tpot.labels(kind).observe(tpot_ms / 1000.0)

    def observed(self, route: str, predicted_ttft_ms: float | None, predicted_tpot_ms: float | None,
                 ttft_s: float, tpot_s: float | None) -> None:
        """One finished stream: its TTFT and TPOT (None: fewer than two tokens) against the estimates
        (None: the request did not go where the policy decided)."""
        if tpot_s is not None:
            self.observed_tpot.labels(route).observe(tpot_s)
        if predicted_ttft_ms:
            self.ttft_ratio.labels(route).observe(ttft_s * 1000.0 / predicted_ttft_ms)
        if predicted_tpot_ms and tpot_s is not None:
            self.tpot_ratio.labels(route).observe(tpot_s * 1000.0 / predicted_tpot_ms)
