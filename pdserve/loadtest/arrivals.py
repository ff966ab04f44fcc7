"""Arrival times of a run's requests (seconds after the start), seeded.

vLLM's convention (``get_request`` in its serving benchmark): intervals between requests are
gamma-distributed with ``shape = burstiness`` and ``scale = 1 / (rate * burstiness)``, so the
mean interval is ``1 / rate`` whatever the burstiness and the squared coefficient of variation
is ``1 / burstiness``: burstiness 1 is a Poisson process (exponential intervals), below 1 is
burstier, above 1 more regular, ``inf`` a fixed interval. Rate ``inf`` sends everything at once.
The first request goes at t = 0, each later one one interval after the previous one (vLLM's
older ``yield`` then ``sleep`` order). ``normalize=True`` rescales the times so the last
request goes at ``(n - 1) / rate`` exactly (newer vLLM does this to steady throughput numbers
across seeds; off by default).

``window_times`` restarts such a process at the start of a time window and keeps the arrivals
before its end; a phased workload (pdserve/loadtest/phases.py) strings windows of different rates.

A fixed concurrency (``max_concurrency``, a semaphore in the client) combines with any of
these: rate ``inf`` + ``max_concurrency`` N is a closed loop of N requests in flight.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Seed = int | Sequence[int] | np.random.Generator   # what numpy.random.default_rng takes


def parse_rate(value: str | float) -> float:
    s = str(value).strip().lower()
    if s in ("inf", "infinity", "max"):
        return math.inf
    rate = float(s)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), not {value!r}")
    return rate


def parse_rates(spec: str) -> list[float]:
    """``"1,2,4,inf"`` -> [1.0, 2.0, 4.0, inf]."""
    rates = [parse_rate(x) for x in str(spec).split(",") if x.strip()]
    if not rates:
        raise ValueError("no request rate given")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def intervals(n: int, rate: float, burstiness: float = 1.0, seed: Seed = 0) -> np.ndarray:
    """``n`` gamma intervals (s) of mean ``1/rate``; all 0 at rate inf, all ``1/rate`` at burstiness inf.
    ``seed`` may be a Generator, which the draws then advance."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, not {burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, not {rate}")
    if math.isinf(burstiness):
        return np.full(n, 1.0 / rate)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0,
                  normalize: bool = False) -> np.ndarray:
    """Send offsets (s) of ``n`` requests: 0, then cumulative intervals (see the module docstring)."""
    if n <= 0:
        return np.zeros(0)
    gaps = intervals(n - 1, rate, burstiness, seed)
    times = np.concatenate([[0.0], np.cumsum(gaps)])
    if normalize and not math.isinf(rate) and n > 1 and times[-1] > 0:
        times *= ((n - 1) / rate) / times[-1]
    return times


def window_times(start: float, end: float, rate: float, burstiness: float = 1.0, seed: Seed = 0) -> np.ndarray:
    """Arrival times in ``[start, end)`` of the process of :func:`intervals` started afresh at
    ``start`` (the first arrival one interval after it): at burstiness 1 the Poisson process of
    ``rate`` on that window, whatever came before. ``rate`` must be finite; seeded like ``intervals``."""
    if not (0 < rate < math.inf):
        raise ValueError(f"a window's rate must be finite and > 0, not {rate}")
    rng = np.random.default_rng(seed)
    mean = rate * max(end - start, 0.0)
    chunk = int(mean + 4 * math.sqrt(mean)) + 8
    parts, t = [], float(start)
    while True:
        times = t + np.cumsum(intervals(chunk, rate, burstiness, rng))
        parts.append(times[times < end])
        if times[-1] >= end:
            return np.concatenate(parts)
        t = float(times[-1])


def split_concurrency(limit: int | None, num_procs: int) -> list[int | None]:
    """A concurrency limit shared out over client processes (each gets at least 1)."""
    if limit is None:
        return [None] * num_procs
    if limit < num_procs:
        raise ValueError(f"max concurrency {limit} is below the number of client processes {num_procs}")
    return [limit // num_procs + (1 if i < limit % num_procs else 0) for i in range(num_procs)]
