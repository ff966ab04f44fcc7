"""Typed reads of a JSON request body's fields: each wrong type or value is a 400 naming the
field. ``null`` counts as absent (OpenAI's SDKs send it for unset optional fields)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pdserve.router.openai_api.errors import bad_request

_MISSING = object()


def _get(body: dict, name: str) -> Any:
    value = body.get(name, _MISSING)
    return _MISSING if value is None else value


def number(body: dict, name: str, default: float, lo: float | None = None, hi: float | None = None,
           lo_open: bool = False) -> float:
    """A finite number (int or float, not bool) in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    value = _get(body, name)
    if value is _MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(name, f"must be a number, got {value!r}")
    low_ok = lo is None or (value > lo if lo_open else value >= lo)
    if not low_ok or (hi is not None and value > hi):
        span = f"{'(' if lo_open else '['}{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise bad_request(name, f"must be in {span}, got {value}")
    return float(value)


def integer(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    """An integer (not bool) in [lo, hi]."""
    value = _get(body, name)
    if value is _MISSING:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(name, f"must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], "
                                f"got {value}")
    return value


def _of_type(body: dict, name: str, default: Any, kind: type, wrong: Callable[[Any], str]) -> Any:
    """The value of ``name`` if it is a ``kind``, ``default`` if absent; else a 400 saying
    ``wrong(value)``."""
    value = _get(body, name)
    if value is _MISSING:
        return default
    if not isinstance(value, kind):
        raise bad_request(name, wrong(value))
    return value


def boolean(body: dict, name: str, default: bool) -> bool:
    return _of_type(body, name, default, bool, lambda v: f"must be true or false, got {v!r}")


def string(body: dict, name: str, default: str | None = None) -> str | None:
    return _of_type(body, name, default, str, lambda v: f"must be a string, got {type(v).__name__}")


def obj(body: dict, name: str) -> dict | None:
    return _of_type(body, name, None, dict, lambda v: f"must be an object, got {type(v).__name__}")


def string_list(body: dict, name: str) -> list[str]:
    """A string or a list of strings (as ``stop``)."""
    value = _get(body, name)
    if value is _MISSING:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad_request(name, "must be a string or a list of strings")
    return value


def int_list(body: dict, name: str, lo: int = 0, hi: int = 2**32 - 1) -> list[int]:
    value = _get(body, name)
    if value is _MISSING:
        return []
    if not isinstance(value, list):
        raise bad_request(name, "must be a list of integers")
    for i, v in enumerate(value):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise bad_request(f"{name}[{i}]", f"must be an integer in [{lo}, {hi}], got {v!r}")
    return value


def only(body: dict, name: str, allowed: tuple[Any, ...], why: str) -> None:
    """Refuse any value of ``name`` but absent/null and ``allowed`` (features not served)."""
    value = _get(body, name)
    if value is not _MISSING and value not in allowed:
        raise bad_request(name, why)
