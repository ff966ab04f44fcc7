"""Every environment variable pdserve reads, in one place.

Services and tools call these helpers; nothing else in the project reads ``os.environ`` for
pdserve settings. Each variable is a default that a command-line flag overrides.
"""
from __future__ import annotations

import os
from pathlib import Path

PREFIX = "PDSERVE_"


def get(name: str, default: str | None = None) -> str | None:
    """Value of ``PDSERVE_<name>`` or ``default``."""
    return os.environ.get(PREFIX + name, default)


def get_int(name: str, default: int) -> int:
    value = get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"environment variable {PREFIX}{name}={value!r} is not an integer") from e


def get_float(name: str, default: float) -> float:
    value = get(name)
    if value is None or value == "":
        return default
    try:
        return float(value)
    except ValueError as e:
        raise ValueError(f"environment variable {PREFIX}{name}={value!r} is not a number") from e


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
