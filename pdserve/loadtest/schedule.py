"""What a run sends and when: a :class:`Schedule` (requests, their send offsets, and the phase
windows of a workload that has phases), and :data:`Workload`, what builds run k's schedule at a
rate. This is the one seam between a workload and the arrival process.

Most datasets are a list of requests that any arrival process can send: :func:`spaced` gives
them the offsets of ``arrivals.arrival_times`` (vLLM's gamma/Poisson process at the run's rate).
A workload whose arrival process is part of it (``phases``, pdserve/loadtest/phases.py) builds
its own offsets and windows, and its requests may depend on the rate (how many fall in each phase).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.loadtest import arrivals, datasets


@dataclass(frozen=True)
class Window:
    """One stretch of a phased schedule: ``phase``'s traffic at ``rate`` req/s from ``start`` to
    ``end`` (s after the run's start). Its arrivals lie in ``[start, end)``, except that the last
    window of a schedule cut short by its number of requests ends at its last arrival (included)."""

    phase: str
    start: float
    end: float
    rate: float


@dataclass
class Schedule:
    """``requests[i]`` is sent ``offsets[i]`` s after the run's start (offsets non-decreasing).
    ``windows``: a phased workload's windows in time order (empty otherwise); each of its
    requests names its phase in ``extra["phase"]``."""

    requests: list[datasets.BenchRequest]
    offsets: list[float]
    windows: list[Window] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.requests) != len(self.offsets):
            raise ValueError("a schedule needs one offset per request")


# Run k (0: the warm-up; k >= 1: the k-th run of a sweep or search) at a rate (req/s) -> its schedule.
Workload = Callable[[int, float], Schedule]


def spaced(requests: list[datasets.BenchRequest], rate: float, burstiness: float = 1.0, seed: int = 0,
           normalize: bool = False) -> Schedule:
    """``requests`` in order, at the times of ``arrivals.arrival_times`` (its docstring)."""
    offsets = arrivals.arrival_times(len(requests), rate, burstiness, seed, normalize)
    return Schedule(requests, [float(t) for t in offsets])


def summary(s: Schedule) -> dict[str, Any]:
    """``datasets.summary`` of the requests; for a phased schedule also the requests per phase,
    the number of windows and the schedule's length (s, the last window's end)."""
    out = datasets.summary(s.requests)
    if s.windows:
        counts = Counter(r.extra.get("phase") for r in s.requests)
        out["phases"] = {w.phase: counts.get(w.phase, 0) for w in s.windows}
        out["phase_windows"] = len(s.windows)
        out["schedule_s"] = s.windows[-1].end
    return out
