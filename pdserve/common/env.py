"""Every environment variable pdserve reads, in one place: nothing else reads ``os.environ`` for
pdserve settings, and each is a default that a command-line flag overrides."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

PREFIX = "PDSERVE_"
T = TypeVar("T")


def get(name: str, default: str | None = None) -> str | None:
    """Value of ``PDSERVE_<name>`` or ``default``."""
    return os.environ.get(PREFIX + name, default)


def _get_parsed(name: str, default: T, parse: Callable[[str], T], what: str) -> T:
    """``parse`` of ``PDSERVE_<name>``, or ``default`` when unset or empty; a ValueError naming
    the variable and ``what`` it should be when ``parse`` refuses it."""
    value = get(name)
    if value is None or value == "":
        return default
    try:
        return parse(value)
    except ValueError as e:
        raise ValueError(f"environment variable {PREFIX}{name}={value!r} is not {what}") from e


def get_int(name: str, default: int) -> int:
    return _get_parsed(name, default, int, "an integer")


def get_float(name: str, default: float) -> float:
    return _get_parsed(name, default, float, "a number")


def get_bool(name: str, default: bool) -> bool:
    value = get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> Path:
    """Where imported models and other caches live (``PDSERVE_CACHE_DIR``, default ~/.cache/pdserve)."""
    return Path(get("CACHE_DIR") or Path.home() / ".cache" / "pdserve")


def log_level() -> str:
    return (get("LOG_LEVEL") or "INFO").upper()


def fused_ops() -> bool:
    """Fused Triton elementwise kernels on CUDA (``PDSERVE_FUSED_OPS``, default on)."""
    return get_bool("FUSED_OPS", True)


def snapshot() -> dict[str, str]:
    """Every ``PDSERVE_*`` variable set now (benchmark records say which settings they ran)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(PREFIX)}


def dataflow_decode() -> bool:
    """The decode chain, 1 to 256 rows (pdserve/common/models/dataflow_decode.py), where the model
    supports it (``PDSERVE_DATAFLOW_DECODE``, default on)."""
    return get_bool("DATAFLOW_DECODE", True)


def dataflow_wide() -> bool:
    """The chain's Gluon range, beyond its Triton rows up to 256 (pdserve/common/models/dataflow_decode.py),
    on Hopper GPUs where the model supports it (``PDSERVE_DATAFLOW_WIDE``, default on; needs
    ``PDSERVE_DATAFLOW_DECODE`` on too)."""
    return get_bool("DATAFLOW_WIDE", True)


def kv_max_channels() -> int:
    """Most pair channels a worker keeps open (``PDSERVE_KV_MAX_CHANNELS``, default 32; 0 = no cap)."""
    return get_int("KV_MAX_CHANNELS", 32)


def kv_channel_max_ctas() -> int:
    """Most CTAs (NCCL channels) one NCCL pair channel may use (``PDSERVE_KV_CHANNEL_MAX_CTAS``,
    default 4; 0 = NCCL's choice). Each CTA holds its own buffers: see docs/design.md."""
    return get_int("KV_CHANNEL_MAX_CTAS", 4)


def kv_idle_close_s() -> float:
    """A prefill worker closes a pair channel unused this long (``PDSERVE_KV_IDLE_CLOSE_S``,
    default 300 s; 0 = never); a decode worker closes its side after twice that."""
    return get_float("KV_IDLE_CLOSE_S", 300.0)


def log_format() -> str:
    """``text`` (default) or ``json`` (one JSON object per line; ``PDSERVE_LOG_FORMAT``)."""
    return (get("LOG_FORMAT") or "text").lower()


def trace_file() -> str | None:
    """``PDSERVE_TRACE_FILE``: also write finished spans to this file, one JSON object a line."""
    return get("TRACE_FILE") or None


def otel_trace_exporters() -> list[str]:
    """The span exporters the ``OTEL_*`` variables ask for (empty: tracing off): only whether
    tracing is on is decided here; the SDK reads the other variables itself."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = [n.strip().lower() for n in os.environ.get("OTEL_TRACES_EXPORTER", "").split(",")]
    names = [n for n in names if n and n != "none"]
    if not names and not os.environ.get("OTEL_TRACES_EXPORTER") and (
            os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    return names


def otel_otlp_protocol() -> str:
    """``grpc`` (default) or ``http/protobuf``, from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` or
    ``OTEL_EXPORTER_OTLP_PROTOCOL``."""
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc").strip().lower()
