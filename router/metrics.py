"""Prometheus metrics of the router (own registry; served on --metrics-port, 0 = off)."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pdserve_router_requests", "Generate requests by method and final status",
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
        self.workers_up = Gauge("pdserve_router_workers_up", "Healthy registered workers by role", ["role"],
                                registry=r)
        self.finish = Counter("pdserve_router_finish_reasons", "Finished requests by finish reason",
                              ["reason"], registry=r)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            start_http_server(port, addr=host, registry=self.registry)
            log.info("metrics on http://%s:%d/metrics", host, port)
