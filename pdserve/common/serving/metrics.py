"""Prometheus metrics of a worker, named after vLLM's (prefix ``pdserve:`` for ``vllm:``).

Sources: the engine's counters as of its last step (``EngineLoop.stats``, read at scrape time);
the engine thread after every step and per request (:class:`RequestTracker`, which also records
the request's phase spans); the KV transfer on both sides.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdserve.common import telemetry

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
BYTES_BUCKETS = tuple(float(4 ** k) for k in range(8, 16))   # 64 KiB .. 1 GiB
PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"
SEND, RECV = "send", "recv"
# how a request came to this worker: prefilled here for another worker, KV imported from a
# prefill worker (Reserve + PushKV), or prefilled and decoded here (Submit)
KIND_PREFILL, KIND_REMOTE, KIND_LOCAL = "prefill", "remote", "local"


def step_kind(out) -> str:
    """prefill: prompt tokens only; decode: decode rows only; mixed: both in one step."""
    if not out.is_prefill:
        return DECODE
    return MIXED if getattr(out, "num_decode_rows", 0) else PREFILL


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class OneWriterHistogram(Collector):
    """A histogram written by one thread only (the engine thread; the router's event loop),
    without a lock: an observation is a bisect and two additions (prometheus_client's Histogram
    takes a lock and costs microseconds, which per token at a batch of hundreds would be
    milliseconds per step). A scrape reads it as it is."""

    def __init__(self, name: str, documentation: str, buckets, registry: CollectorRegistry,
                 labelnames: tuple[str, ...] = ()) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.bounds = sorted(float(b) for b in buckets)
        self._children: dict[tuple[str, ...], _Buckets] = {}
        if not self.labelnames:
            self.observe = self.labels().observe
        registry.register(self)

    def labels(self, *values: str) -> _Buckets:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = _Buckets(self.bounds)
        return child

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            counts, total, buckets = list(child.counts), 0, []
            for bound, n in zip([*self.bounds, float("inf")], counts):
                total += n
                buckets.append((floatToGoString(bound), total))
            family.add_metric(list(values), buckets, child.sum)
        yield family


class WorkerMetrics:
    """The metrics of one worker process, in their own registry (served by start_metrics)."""

    def __init__(self, role: str) -> None:
        from prometheus_client import GCCollector, PlatformCollector, ProcessCollector
        self.role = role
        self.registry = r = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=r)
        self.stats_source: Callable[[], dict | None] = lambda: None
        r.register(_StatsCollector(self))
        self.step_duration = OneWriterHistogram("pdserve:engine_step_duration_seconds", "Duration of one engine step",
                                             STEP_BUCKETS, r, ("kind",))
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens computed (prefix-cache hits "
                                     "excluded)", registry=r)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens sampled", registry=r)
        self.requests = Counter("pdserve:requests", "Requests accepted, by the RPC that brought them", ["rpc"],
                                registry=r)
        self.request_success = Counter("pdserve:request_success", "Requests that ended here, by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = OneWriterHistogram("pdserve:time_to_first_token_seconds", "Arrival to first token, for "
                                    "requests whose first token is computed here", LATENCY_BUCKETS, r)
        self.itl = OneWriterHistogram("pdserve:inter_token_latency_seconds", "Time between two tokens of a request",
                                   ITL_BUCKETS, r)
        self.e2e = OneWriterHistogram("pdserve:e2e_request_latency_seconds", "Arrival to end of requests decoded "
                                   "here", LATENCY_BUCKETS, r)
        self.queue_time = OneWriterHistogram("pdserve:request_queue_time_seconds", "Ready (submitted, or its KV "
                                          "landed) to its first step", LATENCY_BUCKETS, r)
        self.prefill_time = OneWriterHistogram("pdserve:request_prefill_time_seconds", "Prefill step launch to "
                                            "first token (prefill workers)", LATENCY_BUCKETS, r)
        self.kv_bytes = Histogram("pdserve:kv_transfer_size_bytes", "Bytes of one KV transfer", ["direction"],
                                  buckets=BYTES_BUCKETS, registry=r)
        self.kv_seconds = Histogram("pdserve:kv_transfer_duration_seconds", "Duration of one KV transfer "
                                    "(send: enqueue to crossed; recv: posted to landed)", ["direction"],
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.kv_failures = Counter("pdserve:kv_transfer_failures", "KV transfers that failed", ["direction"],
                                   registry=r)
        self.reservations_expired = Counter("pdserve:reservations_expired", "Reservations whose lease ran out "
                                            "before their KV arrived", registry=r)
        self.step_started = 0.0     # time.time() at the start of the last step (engine thread)
        for kind in (PREFILL, DECODE, MIXED):       # every series present from the start
            self.step_duration.labels(kind)
        for direction in (SEND, RECV):
            self.kv_bytes.labels(direction)
            self.kv_seconds.labels(direction)
            self.kv_failures.labels(direction)

    # ---- engine thread ----------------------------------------------------------------
    def observe_step(self, out, seconds: float) -> None:
        self.step_started = time.time() - seconds
        self.step_duration.labels(step_kind(out)).observe(seconds)
        if out.new_token_ids:
            self.generation_tokens.inc(len(out.new_token_ids))
        computed = getattr(out, "num_prefill_tokens", None)
        if computed is None:
            computed = out.num_computed_tokens if out.is_prefill else 0
        if computed:
            self.prompt_tokens.inc(computed)

    # ---- KV transfer ------------------------------------------------------------------
    async def observe_send(self, request_id: str, ship):
        """Await ``ship`` (a send; it returns a TransferDone) inside a ``kv_transfer`` span and
        count it: bytes and duration, or a failure."""
        with telemetry.span("kv_transfer", request_id, direction=SEND):
            try:
                done = await ship
            except Exception:
                self.kv_failures.labels(SEND).inc()
                raise
        self.kv_bytes.labels(SEND).observe(done.bytes)
        self.kv_seconds.labels(SEND).observe(done.transfer_ms / 1000.0)
        return done

    def watch_receive(self, request_id: str) -> Callable[[Future], None]:
        """A done-callback for a posted receive: counts it and records its ``kv_receive`` span."""
        start, parent = time.time(), telemetry.parent()

        def done(future: Future) -> None:
            end = time.time()
            error = future.exception()
            if error is not None:
                self.kv_failures.labels(RECV).inc()
            else:
                self.kv_bytes.labels(RECV).observe(future.result().num_bytes)
                self.kv_seconds.labels(RECV).observe(end - start)
            telemetry.record_span("kv_receive", start, end, parent, request_id, direction=RECV,
                                  error=str(error) if error is not None else None)
        return done


class _StatsCollector(Collector):
    """Gauges and counters from the engine's last stats snapshot (nothing until it is loaded)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def collect(self):
        try:
            s = self.metrics.stats_source()
        except Exception:  # noqa: BLE001 - still loading: no engine series yet
            s = None
        if not s:
            return
        total = s.get("num_total_blocks", 0)
        yield GaugeMetricFamily("pdserve:num_requests_running", "Requests in the running batch",
                                value=s.get("num_running", 0))
        yield GaugeMetricFamily("pdserve:num_requests_waiting", "Requests waiting to be scheduled",
                                value=s.get("num_waiting", 0))
        yield GaugeMetricFamily("pdserve:num_requests_reserved", "Requests holding blocks for KV not yet landed",
                                value=s.get("num_reserved", 0))
        yield GaugeMetricFamily("pdserve:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)",
                                value=s.get("num_used_blocks", 0) / total if total else 0.0)
        yield GaugeMetricFamily("pdserve:num_kv_blocks", "KV blocks in the pool", value=total)
        yield GaugeMetricFamily("pdserve:tensor_parallel_size", "Ranks (GPUs) the model is split over",
                                value=s.get("tensor_parallel_size", 1))
        yield CounterMetricFamily("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s.get("prefix_cache_query_tokens", 0))
        yield CounterMetricFamily("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.get("prefix_cache_hit_tokens", 0))
        yield CounterMetricFamily("pdserve:num_preemptions", "Sequences preempted (recomputed later)",
                                  value=s.get("num_preemptions", 0))


@dataclass(slots=True)
class _Times:
    kind: str
    arrival: float
    parent: object                  # span context of the RPC that brought it (tracing on)
    ready: float = 0.0              # schedulable here: submitted, or its KV landed
    first_step: float = 0.0         # its first step here started (prefill: launched)
    first_token: float = 0.0        # its first token here
    last_token: float = 0.0


class RequestTracker:
    """Per-request times on a worker; every method runs under the engine's state lock (on the
    engine thread, or off it through ``EngineLoop.now``: never two at once)."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics
        self._times: dict[str, _Times] = {}

    def begin(self, request_id: str, kind: str, rpc: str) -> None:
        now = time.time()
        self._times[request_id] = _Times(kind, now, telemetry.parent(),
                                         ready=0.0 if kind == KIND_REMOTE else now)
        self.metrics.requests.labels(rpc).inc()

    def ready(self, request_id: str) -> None:
        """Its KV landed: it can be scheduled."""
        t = self._times.get(request_id)
        if t is not None:
            t.ready = time.time()

    def launched(self, request_id: str) -> None:
        """Its prefill step was launched (prefill workers)."""
        t = self._times.get(request_id)
        if t is not None and not t.first_step:
            t.first_step = time.time()
            self.metrics.queue_time.observe(t.first_step - t.ready)

    def reservation_expired(self) -> None:
        self.metrics.reservations_expired.inc()

    def on_step(self, out) -> None:
        """After each step: tokens (TTFT, inter-token latency, queue time), then the finished."""
        now, times, m = time.time(), self._times, self.metrics
        for seq in out.seqs:
            t = times.get(seq.request_id)
            if t is None:
                continue
            if not t.first_step:
                t.first_step = m.step_started
                m.queue_time.observe(max(0.0, t.first_step - t.ready))
            if t.last_token:
                m.itl.observe(now - t.last_token)
            else:
                t.first_token = now
                if t.kind != KIND_REMOTE:    # a remote request's first token came from its prefill worker
                    m.ttft.observe(now - t.arrival)
            t.last_token = now
        for seq in out.finished:
            if seq.all_samples_finished:     # a request of n samples ends with its last
                self.end(seq.request_id, seq.finish_reason)

    def end(self, request_id: str, reason) -> None:
        """The request ended here (finished, cancelled, failed, or handed over by a prefill worker)."""
        t = self._times.pop(request_id, None)
        if t is None:
            return
        now = time.time()
        if t.kind == KIND_PREFILL:
            if t.first_step and t.last_token:
                self.metrics.prefill_time.observe(t.last_token - t.first_step)
        else:
            self.metrics.e2e.observe(now - t.arrival)
            self.metrics.request_success.labels(getattr(reason, "value", None) or "none").inc()
        if t.parent is not None:
            self._spans(request_id, t, now)

    @staticmethod
    def _spans(request_id: str, t: _Times, now: float) -> None:
        """queue_wait, then prefill (prefilled here) and decode (decoded here)."""
        if not t.first_step:
            return
        telemetry.record_span("queue_wait", t.ready or t.arrival, t.first_step, t.parent, request_id)
        decode_from = t.first_step
        if t.kind != KIND_REMOTE:
            decode_from = t.first_token or now
            telemetry.record_span("prefill", t.first_step, decode_from, t.parent, request_id, route=t.kind)
        if t.kind != KIND_PREFILL:
            telemetry.record_span("decode", decode_from, now, t.parent, request_id, route=t.kind)
