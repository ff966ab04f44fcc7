"""The request flow with per-route latency metrics and tracing around it.

``ObservedFlow`` is :class:`~pdserve.router.flow.Flow` plus, per request: the route it took
(``local`` or ``remote``, the last dispatch wins), TTFT and inter-token latency per route as each
message leaves, TPOT and both figures against pd_policy's estimates (pdserve.router.pd_metrics),
and with tracing on a ``route`` span from arrival to the first worker rpc.
"""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from pdserve.common import telemetry
from pdserve.router.attempt import Attempt
from pdserve.router.flow import Flow, Job
from pdserve.router.output import TextOutput
from pdserve.router.pd_policy import PdDecision

LOCAL, REMOTE = "local", "remote"


class ObservedFlow(Flow):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._routes: dict[int, str] = {}       # id(job) -> route, while the request runs
        self._decisions: dict[int, PdDecision | None] = {}  # id(job) -> the last attempt's placement
        self._arrivals: dict[int, tuple[float, object]] = {}   # id(job) -> (time.time(), span parent)

    def dispatched(self, att: Attempt) -> None:
        key = id(att.job.origin or att.job)       # a migration's continuation counts as its request
        route = LOCAL if att.prefill is None else REMOTE
        if key not in self._routes and telemetry.enabled():
            arrival = self._arrivals.get(key)
            if arrival is not None:
                telemetry.record_span("route", arrival[0], time.time(), arrival[1], att.job.request_id,
                                      route=route, decode_worker=att.decode.key,
                                      prefill_worker=att.prefill.key if att.prefill is not None else None,
                                      worker_request_id=att.rid)
        self._routes[key] = route
        self._decisions[key] = att.decision
        super().dispatched(att)

    async def generate(self, job: Job, method: str = "Generate"
                       ) -> AsyncGenerator[TextOutput, None]:
        key = id(job)
        started = time.monotonic()
        last = first = 0.0
        tokens = 0
        telemetry.bind_request(job.request_id)
        if telemetry.enabled():
            self._arrivals[key] = (time.time(), telemetry.parent())
        try:
            async for resp in super().generate(job, method):
                if resp.token_ids:
                    now = time.monotonic()
                    route = self._routes.get(key, LOCAL)
                    if last:
                        self.metrics.route_itl.labels(route).observe(now - last)
                    else:
                        self.metrics.route_ttft.labels(route).observe(now - started)
                        first = now
                    last = now
                    tokens += len(resp.token_ids)
                yield resp
        finally:
            taken = self._routes.pop(key, None)
            decision = self._decisions.pop(key, None)
            self._arrivals.pop(key, None)
            if first and taken is not None:
                self._observe_estimates(taken, decision, first - started,
                                        (last - first) / (tokens - 1) if tokens > 1 else None)

    def _observe_estimates(self, route: str, decision: PdDecision | None, ttft_s: float,
                           tpot_s: float | None) -> None:
        est_ttft: float | None = None       # the estimates, when the request went as decided
        est_tpot: float | None = None
        if decision is not None and decision.kind == route:
            est_ttft, est_tpot = decision.ttft_ms, decision.tpot_ms
        self.metrics.pd.observed(route, est_ttft, est_tpot, ttft_s, tpot_s)
