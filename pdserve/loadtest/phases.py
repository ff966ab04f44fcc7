"""The ``phases`` workload: traffic that changes. Windows of ``prefill-heavy``, ``shared-prefix``
and ``decode-heavy`` traffic, in that order, each ``phase_seconds`` long, repeating; window j
(from 0) is phase j mod 3 and runs from ``j * phase_seconds`` to ``(j + 1) * phase_seconds``.
Each phase's rate is its multiplier (default 1, 3, 2) times the run's base rate; within a window
the arrivals are the process of ``arrivals.window_times`` (Poisson at burstiness 1) restarted at
the window's start, seeded by (seed, j), so the whole run is a Poisson process of piecewise
constant rate.

The sub-workloads are bench/gpu_capacity.sh's (:data:`WORKLOADS`). The k-th arrival of a phase,
counted over the whole run, is the k-th request of that phase's dataset (``datasets.build`` with
the run's seed plus the phase's index and the run's variant), so its shared prefixes recur in every
window of the phase. A variant keeps every arrival time, phase, length and shared prefix and
changes the other ids (datasets module docstring); the arrival times depend on the seed and the
base rate only.

The run ends after ``num_prompts`` arrivals (its last window cut at its last arrival) or after
``cycles`` full cycles of the three phases, whichever comes first (neither given: one cycle).
"""
from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pdserve.loadtest import arrivals, capacity, datasets, metrics
from pdserve.loadtest.schedule import Schedule, Window, Workload

PHASES = ("prefill-heavy", "shared-prefix", "decode-heavy")
DEFAULT_MULTIPLIERS = (1.0, 3.0, 2.0)
DEFAULT_PHASE_SECONDS = 45.0
# datasets.build arguments of each phase (bench/gpu_capacity.sh's three workloads)
WORKLOADS: dict[str, dict[str, Any]] = {
    "prefill-heavy": {"input_len": (2000, 4000), "output_len": (100, 300)},
    "shared-prefix": {"num_prefixes": 16, "prefix_len": 2000, "input_len": (100, 500), "output_len": (100, 500)},
    "decode-heavy": {"input_len": (200, 800), "output_len": (500, 1500)},
}


def parse_multipliers(spec: str | Sequence[float]) -> tuple[float, ...]:
    """``"1,3,2"`` -> (1.0, 3.0, 2.0): one finite multiplier > 0 per phase of :data:`PHASES`."""
    items = [float(x) for x in spec.split(",") if x.strip()] if isinstance(spec, str) else [float(x) for x in spec]
    if len(items) != len(PHASES) or not all(0 < m < math.inf for m in items):
        raise ValueError(f"phase rates {spec!r}: need {len(PHASES)} finite multipliers > 0 "
                         f"(for {', '.join(PHASES)})")
    return tuple(items)


def phase_times(num_prompts: int | None, base_rate: float, seed: int = 0,
                phase_seconds: float = DEFAULT_PHASE_SECONDS,
                multipliers: str | Sequence[float] = DEFAULT_MULTIPLIERS, burstiness: float = 1.0,
                cycles: int | None = None) -> tuple[list[float], list[int], list[Window]]:
    """The arrival times (s, non-decreasing), each arrival's phase (an index of :data:`PHASES`) and
    the windows of a phased run (module docstring), without its requests."""
    mult = parse_multipliers(multipliers)
    if not 0 < base_rate < math.inf or not 0 < phase_seconds < math.inf:
        raise ValueError(f"phases need a finite base rate and phase length > 0 (rate {base_rate}, "
                         f"phase {phase_seconds} s)")
    if (num_prompts is not None and num_prompts < 1) or (cycles is not None and cycles < 1):
        raise ValueError("num_prompts and cycles must be >= 1")
    bounded = cycles is not None or num_prompts is None      # else: as many windows as num_prompts needs
    last = len(PHASES) * (cycles or 1)
    times: list[float] = []
    phase_of: list[int] = []
    windows: list[Window] = []
    j = 0
    while not bounded or j < last:
        i, start = j % len(PHASES), j * float(phase_seconds)
        rate = base_rate * mult[i]
        ts = arrivals.window_times(start, start + phase_seconds, rate, burstiness, [seed, j]).tolist()
        if num_prompts is not None:
            ts = ts[:num_prompts - len(times)]
        times += ts
        phase_of += [i] * len(ts)
        done = num_prompts is not None and len(times) >= num_prompts
        windows.append(Window(PHASES[i], start, times[-1] if done else start + phase_seconds, rate))
        if done:
            break
        j += 1
    return times, phase_of, windows


def _phase_requests(name: str, index: int, count: int, seed: int, variant: int, vocab: int,
                    params: Mapping[str, Any], **common: Any) -> list[datasets.BenchRequest]:
    """``count`` requests of phase ``name`` (its dataset with ``params``), tagged with the phase."""
    if count == 0:
        return []
    reqs = datasets.build(name, num_prompts=count, vocab=vocab, seed=seed + index, variant=variant,
                          **dict(params), **common)
    return [replace(r, extra={**r.extra, "phase": name}) for r in reqs]


def build(num_prompts: int | None, base_rate: float, seed: int = 0, variant: int = 0,
          phase_seconds: float = DEFAULT_PHASE_SECONDS, multipliers: str | Sequence[float] = DEFAULT_MULTIPLIERS,
          vocab: int = 10000, *, burstiness: float = 1.0, cycles: int | None = None,
          workloads: Mapping[str, Mapping[str, Any]] | None = None, temperature: float | None = None,
          ignore_eos: bool | None = None, prompt_format: str = "ids",
          max_model_len: int | None = None) -> Schedule:
    """A phased run (module docstring) at ``base_rate`` req/s: its requests in arrival order,
    their send offsets and its windows. ``workloads`` replaces :data:`WORKLOADS` entries (phase ->
    ``datasets.build`` arguments); the keyword arguments after it are ``datasets.build``'s.
    Deterministic for (arguments, seed, variant); needs no server and no argparse."""
    times, phase_of, windows = phase_times(num_prompts, base_rate, seed, phase_seconds, multipliers,
                                           burstiness, cycles)
    params = {**WORKLOADS, **(workloads or {})}
    common = {"temperature": temperature, "ignore_eos": ignore_eos, "prompt_format": prompt_format,
              "max_model_len": max_model_len}
    drawn = [iter(_phase_requests(name, i, phase_of.count(i), seed, variant, vocab, params[name], **common))
             for i, name in enumerate(PHASES)]
    return Schedule([next(drawn[i]) for i in phase_of], times, windows)


def phase_metrics(records: Sequence[metrics.RequestRecord], sched: Schedule,
                  percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES,
                  slo: dict[str, float] | None = None, itl_mode: str = "chunk") -> dict[str, dict[str, Any]]:
    """Per phase that sent a request, in :data:`PHASES` order: ``compute_metrics`` over the
    records of its requests (``records[].index`` into ``sched.requests``), with the sum of its
    windows' lengths as the duration (so throughput and goodput are per second of that phase),
    plus its offered ``request_rate`` and ``num_windows``."""
    groups: dict[str, list[metrics.RequestRecord]] = {}
    for rec in records:
        groups.setdefault(sched.requests[rec.index].extra.get("phase", ""), []).append(rec)
    out: dict[str, dict[str, Any]] = {}
    for name in PHASES:
        wins = [w for w in sched.windows if w.phase == name]
        if not groups.get(name) or not wins:
            continue
        seconds = max(sum(w.end - w.start for w in wins), 1e-9)
        out[name] = {"request_rate": wins[0].rate, "num_windows": len(wins),
                     **metrics.compute_metrics(groups[name], seconds, percentiles, slo, itl_mode)}
    return out


def attainment(phase_results: Mapping[str, Mapping[str, Any]], min_attainment: float) -> dict[str, dict[str, Any]]:
    """Per phase: its SLO attainment, ITL p99 (with an itl_p99 SLO) and whether it alone would
    hold (``capacity.holds``); the run holds or not as a whole."""
    return {name: {**{k: p[k] for k in ("slo_attainment", "itl_p99_ms") if k in p},
                   "holds": capacity.holds(dict(p), min_attainment)}
            for name, p in phase_results.items()}


def format_phases(phase_results: Mapping[str, Mapping[str, Any]],
                  percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES) -> str:
    """One line per phase: offered rate and length, completed, throughput, goodput and SLO
    attainment (with SLOs), TTFT and TPOT mean / highest percentile."""
    p_hi = "p" + metrics.percentile_key(max(percentiles, default=99.0))
    lines = []
    for name, p in phase_results.items():
        line = (f"phase {name:<14} {p['request_rate']:g} req/s x {p['duration']:.0f} s: "
                f"{p['completed']}/{p['num_requests']} completed, {p['request_throughput']:.2f} req/s")
        if p.get("request_goodput") is not None:
            line += f", goodput {p['request_goodput']:.2f} req/s, SLO attainment {p['slo_attainment']:.1%}"
        for m, digits in (("ttft", 0), ("tpot", 1)):
            hi = p.get(f"{p_hi}_{m}_ms")
            line += f", {m.upper()} mean/{p_hi} {p[f'mean_{m}_ms']:.{digits}f}/" + \
                (f"{hi:.{digits}f} ms" if hi is not None else "- ms")
        lines.append(line)
    return "\n".join(lines)


def check_args(args: argparse.Namespace) -> tuple[float, ...]:
    """The multipliers of ``--phase-rates``; ValueError for a flag that ``--dataset phases`` refuses."""
    for flag, bad in (("--input-len", args.input_len), ("--output-len", args.output_len),
                      ("--dataset-path", args.dataset_path), ("--normalize-arrivals", args.normalize_arrivals),
                      ("--closed-loop-turns", getattr(args, "closed_loop_turns", False))):
        if bad:
            raise ValueError(f"--dataset phases does not take {flag} (its phases have fixed workloads)")
    return parse_multipliers(args.phase_rates)


def workload_from_args(args: argparse.Namespace, vocab: int, max_model_len: int | None) -> Workload:
    """``--dataset phases`` of ``pdserve bench serve|compare``: run k at base rate r -> variant k
    (0 for every run with ``--same-prompts``) of the phased run at r."""
    mult = check_args(args)
    kw: dict[str, Any] = {"seed": args.seed, "phase_seconds": args.phase_seconds, "multipliers": mult,
                          "vocab": vocab, "burstiness": float(args.burstiness), "cycles": args.phase_cycles,
                          "temperature": args.temperature, "ignore_eos": args.ignore_eos,
                          "prompt_format": args.prompt_format, "max_model_len": max_model_len}

    def at(k: int, rate: float) -> Schedule:
        return build(args.num_prompts, rate, variant=0 if getattr(args, "same_prompts", False) else k, **kw)
    return at
