"""SLO capacity: the highest Poisson rate a deployment serves within its SLOs (``pdserve bench
compare --capacity``). A rate holds when at least ``min_attainment`` of its requests met every
per-request SLO and, if given, the run's ITL p99 is within ``itl_p99_ms``. The capacity is
bracketed (from a rate list or ``LO:HI``) and bisected down to ``tolerance``; it is the last rate
that held (0: none; a lower bound when ``HI`` held).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_ATTAINMENT = 0.9
DEFAULT_TOLERANCE = 1.0


@dataclass(frozen=True)
class CapacitySearch:
    rates: tuple[float, ...] = ()          # a rate list, or
    bracket: tuple[float, float] | None = None   # (lo, hi)
    tolerance: float = DEFAULT_TOLERANCE
    min_attainment: float = DEFAULT_ATTAINMENT
    max_runs: int = 16

    def __post_init__(self) -> None:
        if bool(self.rates) == (self.bracket is not None):
            raise ValueError("a capacity search starts from a rate list or from a LO:HI bracket (one of them)")
        if any(r <= 0 for r in self.rates) or (self.bracket and not 0 < self.bracket[0] < self.bracket[1]):
            raise ValueError("capacity rates must be finite and > 0, and LO < HI")
        if self.tolerance <= 0 or not 0 < self.min_attainment <= 1:
            raise ValueError("tolerance must be > 0 and min_attainment in (0, 1]")


@dataclass
class Capacity:
    capacity: float                  # highest rate that held (0: none did)
    upper: float | None              # lowest rate that failed (None: none failed: capacity is a lower bound)
    points: list[dict[str, Any]] = field(default_factory=list)   # {rate, holds, ...} in the order run

    @property
    def bounded(self) -> bool:
        return self.upper is not None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bounded": self.bounded}


def holds(result: dict[str, Any], min_attainment: float = DEFAULT_ATTAINMENT) -> bool:
    """Whether a run's metrics (pdserve.loadtest.metrics.compute_metrics with SLOs) meet the SLOs."""
    return result.get("slo_attainment", 0.0) >= min_attainment and result.get("itl_p99_ok", True)


def parse_bracket(spec: str) -> tuple[float, float]:
    lo, sep, hi = spec.partition(":")
    if not sep:
        raise ValueError(f"--capacity-range {spec!r}: expected LO:HI (req/s)")
    return float(lo), float(hi)


def find_capacity(search: CapacitySearch, run: Callable[[float], bool | tuple[bool, dict[str, Any]]]) -> Capacity:
    """Bracket, then bisect (see the module docstring). ``run(rate)`` runs one point and says
    whether it held (optionally with a summary kept in ``points``)."""
    points: list[dict[str, Any]] = []

    def check(rate: float) -> bool:
        out = run(rate)
        ok, info = (out, {}) if isinstance(out, bool) else out
        points.append({"rate": rate, "holds": ok, **info})
        return ok

    lo, hi = _bracket(search, check)
    while hi is not None and hi - lo > search.tolerance and len(points) < search.max_runs:
        mid = round((lo + hi) / 2, 3)
        if check(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, hi, points)


def _bracket(search: CapacitySearch, check: Callable[[float], bool]) -> tuple[float, float | None]:
    if search.bracket is not None:
        lo, hi = search.bracket
        if not check(lo):
            return 0.0, lo
        return (lo, hi) if not check(hi) else (hi, None)
    last_ok = 0.0
    for rate in sorted(search.rates):
        if not check(rate):
            return last_ok, rate
        last_ok = rate
    return last_ok, None


def markdown(rows: Sequence[tuple[str, Capacity]], slo: dict[str, float], min_attainment: float) -> str:
    """One line per deployment: its capacity, the bracket, and the figures at the capacity."""
    bound = ", ".join(f"{k} <= {v:g} ms" for k, v in slo.items())
    lines = [f"SLO capacity: highest rate with >= {min_attainment:.0%} of requests within {bound or 'no SLO'}",
             "", "| deployment | SLO capacity (req/s) | failed at (req/s) | runs | attainment at capacity | "
             "ITL p99 at capacity (ms) |", "|---|---|---|---|---|---|"]
    for name, cap in rows:
        at = next((p for p in cap.points if p["rate"] == cap.capacity), {})
        upper = f"{cap.upper:g}" if cap.upper is not None else "- (lower bound)"
        att = f"{at['slo_attainment']:.1%}" if "slo_attainment" in at else "-"
        itl = f"{at['itl_p99_ms']:.1f}" if "itl_p99_ms" in at else "-"
        lines.append(f"| {name} | {cap.capacity:g} | {upper} | {len(cap.points)} | {att} | {itl} |")
    return "\n".join(lines)


def search_from_args(args) -> CapacitySearch:
    """``--capacity-range LO:HI``, else the finite rates of ``--request-rate``."""
    import math

    from pdserve.loadtest import arrivals
    common = {"tolerance": args.capacity_tolerance, "min_attainment": args.slo_attainment}
    if args.capacity_range:
        return CapacitySearch(bracket=parse_bracket(args.capacity_range), **common)
    rates = tuple(r for r in arrivals.parse_rates(args.request_rate) if math.isfinite(r))
    return CapacitySearch(rates=rates, **common)
