"""Prometheus metrics of the router (own registry; served on --metrics-port, 0 = off)."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from pdserve.common.grpc_utils.errors import status_for
from pdserve.common.serving.metrics import OneWriterHistogram
from pdserve.router.admission import REASONS as REFUSAL_REASONS
from pdserve.router.pd_metrics import PdMetrics

log = logging.getLogger(__name__)

# Placement decision time (choice of the workers of one request), 5 us .. 50 ms (a contended
# host's preemptions land in the top buckets instead of beyond them).
_DECISION_BUCKETS = (5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 1.5e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2e-3, 5e-3,
                     1e-2, 2e-2, 5e-2)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
ROUTES = ("local", "remote")   # prefilled on the decode worker (Submit) | on a prefill worker (Reserve + Prefill)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_router_requests", "Generate requests by method and final status "
                                "(refused ones too: INVALID_ARGUMENT ...)",
                                ["method", "status"], registry=r)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Time to first token (router receipt to first "
                              "token sent)", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Request latency, end to end",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=r)
        self.output_tokens = Counter("pdserve_router_output_tokens", "Tokens generated", registry=r)
        self.cached_tokens = Counter("pdserve_router_cached_tokens", "Prompt tokens served from a prefix cache",
                                     registry=r)
        self.in_flight = Gauge("pdserve_router_in_flight", "Generate requests in flight", registry=r)
        self.retries = Counter("pdserve_router_retries", "Requests retried on another worker before their "
                               "first token", registry=r)
        self.migrations = Counter("pdserve_router_migrations", "Streams cut after their first token and "
                                  "continued on another worker", registry=r)
        self.decision = Histogram("pdserve_router_decision_seconds", "Time to choose the workers of a request "
                                  "(prefix match + policy)", buckets=_DECISION_BUCKETS, registry=r)
        self.workers_up = Gauge("pdserve_router_workers_up", "Healthy registered workers by role", ["role"],
                                registry=r)
        # by route (see pdserve.router.observed): label route = local | remote
        # (written on the event loop only: no lock per observation)
        self.route_ttft = OneWriterHistogram("pdserve_router_time_to_first_token_seconds", "Time to first token "
                                             "by route (router receipt to first token sent)", _LATENCY_BUCKETS, r,
                                             ("route",))
        self.route_itl = OneWriterHistogram("pdserve_router_inter_token_latency_seconds", "Time between two "
                                            "messages with tokens of one stream, by route", _ITL_BUCKETS, r,
                                            ("route",))
        for route in ROUTES:        # every series present from the start (dashboards, rate())
            self.route_ttft.labels(route)
            self.route_itl.labels(route)
        self.refusals = Counter("pdserve_router_requests_refused", "Requests refused by admission control "
                                "(RESOURCE_EXHAUSTED / HTTP 429) by the bound that refused them "
                                "(pdserve.router.admission)", ["reason"], registry=r)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(reason)
        self.finish = Counter("pdserve_router_finish_reasons", "Finished requests by finish reason",
                              ["reason"], registry=r)
        self.pd = PdMetrics(r)     # prefill placement: decisions, estimates vs what happened

    def rejected(self, method: str, exc: BaseException) -> None:
        """Count a request refused before it ran (validation, tokenization, context) by its status."""
        mapped = status_for(exc)
        self.requests.labels(method, mapped[0].name if mapped else "INTERNAL").inc()

    def refused(self, method: str, reason: str) -> None:
        """Count a request refused by admission control (also under its method's RESOURCE_EXHAUSTED)."""
        self.refusals.labels(reason).inc()
        self.requests.labels(method, "RESOURCE_EXHAUSTED").inc()

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", host, port)
