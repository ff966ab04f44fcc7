"""Tracing (OpenTelemetry) and structured logs for every service; tracing is off unless asked for.

``setup_tracing(service)`` runs once at process start, before any gRPC server or channel. It
turns tracing on when the ``OTEL_*`` variables name an exporter or ``PDSERVE_TRACE_FILE`` names
a file; then gRPC gets OpenTelemetry's interceptors and the helpers record spans (with
``pdserve.request_id``). Off: nothing of OpenTelemetry is imported and every helper returns at
once. Spans timed on another thread are recorded afterwards with :func:`record_span`.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import sys
import threading
import time
from typing import Any

from pdserve.common import env

log = logging.getLogger(__name__)

REQUEST_ID = "pdserve.request_id"
# RPCs that are not part of a request: polled, long-lived or infrastructure; never traced
UNTRACED_METHODS = ("GetStats", "Subscribe", "StreamKvEvents", "Info", "ServerReflectionInfo")

_tracer = None                      # an opentelemetry Tracer while tracing is on
_NULL = contextlib.nullcontext()
_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("pdserve_request_id", default="")


def enabled() -> bool:
    return _tracer is not None


def setup_tracing(service: str) -> bool:
    """Turn tracing on if the environment asks for it (see the module doc); True if on."""
    global _tracer
    exporters = env.otel_trace_exporters()
    path = env.trace_file()
    if _tracer is not None or not (exporters or path):
        return _tracer is not None
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = resource.merge(Resource({"service.name": f"pdserve-{service}"}))
    provider = TracerProvider(resource=resource)
    for exporter in [*(_exporter(name) for name in exporters), *([JsonLinesSpanExporter(path)] if path else [])]:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _instrument_grpc(provider)
    _tracer = provider.get_tracer("pdserve")
    log.info("tracing on: %s (service %s)", ", ".join([*exporters, *([f"file {path}"] if path else [])]),
             resource.attributes.get("service.name"))
    return True


def _exporter(name: str):
    if name == "otlp":
        if env.otel_otlp_protocol().startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
            return HttpExporter()
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
        return GrpcExporter()
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter
        return ConsoleSpanExporter(out=sys.stderr)
    raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: pdserve knows otlp, console and none")


def _instrument_grpc(provider) -> None:
    """OpenTelemetry's interceptors on every grpc.aio server and channel made from now on."""
    from opentelemetry.instrumentation.grpc import GrpcAioInstrumentorClient, GrpcAioInstrumentorServer, filters

    traced = filters.negate(filters.any_of(filters.health_check(),
                                           *(filters.method_name(m) for m in UNTRACED_METHODS)))
    GrpcAioInstrumentorServer(filter_=traced).instrument(tracer_provider=provider)
    GrpcAioInstrumentorClient(filter_=traced).instrument(tracer_provider=provider)


def _attributes(request_id: str, attrs: dict[str, Any]) -> dict[str, Any]:
    out = {f"pdserve.{k}": v for k, v in attrs.items() if v is not None}
    if request_id:
        out[REQUEST_ID] = request_id
    return out


def span(name: str, request_id: str = "", **attrs: Any):
    """A context manager: a span that is the current one inside it (a no-op when off)."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=_attributes(request_id, attrs))


def parent():
    """The current span's context, to parent spans recorded later elsewhere (None when off)."""
    if _tracer is None:
        return None
    from opentelemetry import trace
    ctx = trace.get_current_span().get_span_context()
    return ctx if ctx.is_valid else None


def record_span(name: str, start: float, end: float, parent_ctx, request_id: str = "", **attrs: Any) -> None:
    """A finished span from ``start`` to ``end`` (``time.time()`` seconds) under ``parent_ctx``."""
    if _tracer is None or parent_ctx is None:
        return
    from opentelemetry import trace
    context = trace.set_span_in_context(trace.NonRecordingSpan(parent_ctx))
    s = _tracer.start_span(name, context=context, start_time=int(start * 1e9),
                           attributes=_attributes(request_id, attrs))
    s.end(end_time=int(max(end, start) * 1e9))


def bind_request(request_id: str, **attrs: Any) -> None:
    """This task's request id (for the logs), also set on the current span with ``attrs``."""
    _request_id.set(request_id)
    if _tracer is not None:
        from opentelemetry import trace
        current = trace.get_current_span()
        if current.is_recording():
            current.set_attributes(_attributes(request_id, attrs))


class JsonLinesSpanExporter:
    """Appends each finished span to a file as one JSON object per line (several processes may
    share the file: each batch is one ``write`` to a file opened for appending)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._lock = threading.Lock()

    def export(self, spans) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult
        data = "".join(json.dumps(span_to_dict(s), default=str) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd >= 0:
                os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def span_to_dict(s) -> dict[str, Any]:
    ctx, parent_ctx = s.get_span_context(), s.parent
    return {"name": s.name, "service": s.resource.attributes.get("service.name"),
            "trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x"),
            "parent_id": format(parent_ctx.span_id, "016x") if parent_ctx is not None else None,
            "kind": s.kind.name, "start_ns": s.start_time, "end_ns": s.end_time,
            "status": s.status.status_code.name, "attributes": dict(s.attributes or {})}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, request id, trace/span ids."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        request_id = getattr(record, "request_id", None) or _request_id.get()
        if request_id:
            out["request_id"] = request_id
        if _tracer is not None:
            from opentelemetry import trace
            ctx = trace.get_current_span().get_span_context()
            if ctx.is_valid:
                out["trace_id"], out["span_id"] = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, fmt: str | None = None) -> None:
    """The root logger on stderr, as text (default) or JSON lines (``fmt`` or PDSERVE_LOG_FORMAT)."""
    fmt = (fmt or env.log_format()).lower()
    if fmt not in ("text", "json"):
        raise ValueError(f"log format {fmt!r}: text or json")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
