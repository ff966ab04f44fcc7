"""Per-request records of a streamed run, and the serving metrics computed from them, with vLLM's
definitions and JSON keys (``vllm/benchmarks/serve.py``, ``calculate_metrics``).

TTFT, TPOT ``(e2e - ttft) / (output_tokens - 1)``, E2EL from the send time; ITL one gap per
message (``itl_mode="chunk"``, vLLM) or ``k`` gaps of ``gap / k`` (``"split"``, SGLang).
Goodput and SLO attainment count requests within every SLO (ms). Times: perf_counter seconds.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
METRICS = ("ttft", "tpot", "itl", "e2el")
ITL_MODES = ("chunk", "split")
# SLO names accepted on the command line -> vLLM's goodput keys
SLO_ALIASES = {"ttft": "ttft", "ttft_ms": "ttft", "tpot": "tpot", "tpot_ms": "tpot",
               "e2el": "e2el", "e2el_ms": "e2el", "e2e": "e2el", "e2e_ms": "e2el",
               "itl_p99": "itl_p99", "itl_p99_ms": "itl_p99"}
RUN_SLOS = ("itl_p99",)     # bounds on a whole run (the others bound each request)


@dataclass
class RequestRecord:
    """What the client saw of one request (times in perf_counter seconds)."""

    index: int                      # position in the dataset
    scheduled_time: float = 0.0     # when the arrival schedule wanted it sent
    release_time: float = 0.0       # when the client released it (late if the client lags)
    send_time: float = 0.0          # when the call was issued (after any concurrency wait)
    msg_times: list[float] = field(default_factory=list)   # arrival of each streamed message
    msg_tokens: list[int] = field(default_factory=list)    # tokens carried by each message
    end_time: float = 0.0           # when the call ended (status received)
    code: str = ""                  # gRPC status code name; "OK" on success
    error: str = ""
    prompt_tokens: int = 0          # usage.prompt_tokens (or the dataset's count)
    output_tokens: int = 0          # usage.completion_tokens (or the tokens streamed)
    cached_tokens: int = 0          # usage.cached_tokens
    finish_reason: str = ""

    @property
    def success(self) -> bool:
        return self.code == "OK" and any(k > 0 for k in self.msg_tokens)

    @property
    def status(self) -> str:
        """The status for error counts: the gRPC code, or EMPTY_STREAM for OK with no token."""
        if self.code == "OK" and not self.success:
            return "EMPTY_STREAM"
        return self.code or "UNKNOWN"

    def ttft(self) -> float:
        for t, k in zip(self.msg_times, self.msg_tokens):
            if k > 0:
                return t - self.send_time
        raise ValueError("no token-carrying message")

    def e2el(self) -> float:
        return self.end_time - self.send_time

    def tpot(self) -> float:
        """(e2e - ttft) / (output_tokens - 1); 0 for a single-token output (vLLM's goodput rule)."""
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2el() - self.ttft()) / (self.output_tokens - 1)

    def itls(self, mode: str = "chunk") -> list[float]:
        out: list[float] = []
        prev: float | None = None
        for t, k in zip(self.msg_times, self.msg_tokens):
            if k <= 0:
                continue
            if prev is not None:
                gap = t - prev
                if mode == "chunk":
                    out.append(gap)
                elif mode == "split":
                    out.extend([gap / k] * k)
                else:
                    raise ValueError(f"itl mode must be one of {ITL_MODES}, not {mode!r}")
            prev = t
        return out


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def stats_ms(name: str, values_s: Sequence[float], percentiles: Iterable[float]) -> dict[str, float]:
    """mean/median/std/percentiles of ``values_s`` (seconds) as vLLM's ``*_{name}_ms`` keys."""
    v = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(v)), f"median_{name}_ms": float(np.median(v)),
           f"std_{name}_ms": float(np.std(v))}
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(v, p))
    return out


def parse_slo(spec: str | Sequence[str] | None) -> dict[str, float]:
    """``"ttft_ms=500,tpot_ms=50,e2e_ms=10000"`` (or vLLM's ``["ttft:500", "tpot:50"]``) ->
    ``{"ttft": 500.0, "tpot": 50.0, "e2el": 10000.0}`` (milliseconds)."""
    if not spec:
        return {}
    items = spec if not isinstance(spec, str) else [spec]
    parts = [p.strip() for item in items for p in item.split(",") if p.strip()]
    slo: dict[str, float] = {}
    for part in parts:
        sep = "=" if "=" in part else ":"
        name, _, value = part.partition(sep)
        key = SLO_ALIASES.get(name.strip().lower())
        if key is None or not value:
            raise ValueError(f"bad SLO {part!r}: expected NAME=MS with NAME one of "
                             f"ttft_ms, tpot_ms, e2e_ms, itl_p99_ms (or vLLM's ttft:MS, tpot:MS, e2el:MS)")
        ms = float(value)
        if ms < 0 or math.isnan(ms):
            raise ValueError(f"bad SLO {part!r}: the value must be >= 0 ms")
        slo[key] = ms
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether ``rec`` completed within every per-request SLO (run bounds such as itl_p99 aside)."""
    if not rec.success:
        return False
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2el}
    return all(values[k]() * 1000.0 <= ms for k, ms in slo.items() if k not in RUN_SLOS)


def slo_figures(records: Sequence[RequestRecord], slo: dict[str, float], itl_mode: str = "chunk") -> dict[str, Any]:
    """``slo_attainment`` (met / sent) and, with an ``itl_p99`` bound, ``itl_p99_ms`` and ``itl_p99_ok``."""
    out: dict[str, Any] = {"slo_attainment": (sum(meets_slo(r, slo) for r in records) / len(records))
                           if records else 0.0}
    if "itl_p99" in slo:
        itls = [x for r in records if r.success for x in r.itls(itl_mode)]
        p99 = float(np.percentile(np.asarray(itls) * 1000.0, 99)) if itls else 0.0
        out.update(itl_p99_ms=p99, itl_p99_ok=p99 <= slo["itl_p99"])
    return out


def peak_output_rate(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """(most output tokens received in one 1-s bucket, peak requests in flight): vLLM's
    ``max_output_tokens_per_s`` / ``max_concurrent_requests``."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0, 0
    t0 = min(r.send_time for r in ok)
    buckets: Counter[int] = Counter()
    for r in ok:
        for t, k in zip(r.msg_times, r.msg_tokens):
            if k:
                buckets[int(t - t0)] += k
    events = sorted([(r.send_time, 1) for r in ok] + [(r.end_time, -1) for r in ok])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return float(max(buckets.values(), default=0)), peak


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                    slo: dict[str, float] | None = None, itl_mode: str = "chunk") -> dict[str, Any]:
    """The vLLM-style result dict of one run (see the module docstring)."""
    if itl_mode not in ITL_MODES:
        raise ValueError(f"itl mode must be one of {ITL_MODES}, not {itl_mode!r}")
    if duration_s <= 0:
        raise ValueError("duration must be > 0")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft() for r in ok]
    e2els = [r.e2el() for r in ok]
    tpots = [r.tpot() for r in ok if r.output_tokens > 1]
    itls = [x for r in ok for x in r.itls(itl_mode)]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    n_msgs = sum(1 for r in ok for k in r.msg_tokens if k > 0)
    good = sum(1 for r in ok if meets_slo(r, slo)) if slo else None
    errors = Counter(r.status for r in records if not r.success)
    peak_tps, peak_conc = peak_output_rate(records)
    result: dict[str, Any] = {
        "duration": duration_s,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (good / duration_s) if good is not None else None,
        "good_completed": good,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_tps,
        "max_concurrent_requests": peak_conc,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "mean_tokens_per_message": (total_out / n_msgs) if n_msgs else 0.0,
        "itl_mode": itl_mode,
        "error_counts": dict(sorted(errors.items())),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        result.update(stats_ms(name, values, percentiles))
    if slo:
        result.update(slo_figures(records, slo, itl_mode))
    return result


def detailed_lists(records: Sequence[RequestRecord], itl_mode: str = "chunk") -> dict[str, list]:
    """Per-request arrays under vLLM's ``--save-detailed`` names (seconds), in dataset order."""
    recs = sorted(records, key=lambda r: r.index)
    return {
        "input_lens": [r.prompt_tokens for r in recs],
        "output_lens": [r.output_tokens if r.success else 0 for r in recs],
        "ttfts": [r.ttft() if r.success else 0.0 for r in recs],
        "itls": [r.itls(itl_mode) if r.success else [] for r in recs],
        "latencies": [r.e2el() if r.success else 0.0 for r in recs],
        "start_times": [r.send_time for r in recs],
        "queue_times": [r.send_time - r.release_time for r in recs],
        "errors": [r.error if not r.success else "" for r in recs],
        "status_codes": [r.status for r in recs],
    }


def latency_samples(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """TTFT / TPOT / E2EL samples in ms (for CDF plots)."""
    ok = [r for r in records if r.success]
    return {"ttft": [r.ttft() * 1000 for r in ok],
            "tpot": [r.tpot() * 1000 for r in ok if r.output_tokens > 1],
            "e2el": [r.e2el() * 1000 for r in ok]}


def format_table(result: dict[str, Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                 title: str = " Serving Benchmark Result ") -> str:
    """The result as vLLM prints it."""
    lines = ["{s:{c}^{n}}".format(s=title, n=50, c="=")]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<40} " + (fmt.format(value) if value is not None else "n/a"))

    row("Successful requests:", result["completed"], "{:<10}")
    row("Failed requests:", result["failed"], "{:<10}")
    for code, n in result["error_counts"].items():
        row(f"  {code}:", n, "{:<10}")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", result["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", result["max_concurrent_requests"], "{:<10}")
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    row("Tokens per streamed message:", result["mean_tokens_per_message"])
    for name, label, header in (("ttft", "TTFT", "Time to First Token"),
                                ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                                ("itl", "ITL", "Inter-token Latency"),
                                ("e2el", "E2EL", "End-to-end Latency")):
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {label} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", result[f"median_{name}_ms"])
        for p in percentiles:
            key = f"p{percentile_key(p)}_{name}_ms"
            if key in result:
                row(f"P{percentile_key(p)} {label} (ms):", result[key])
    lines.append("=" * 50)
    return "\n".join(lines)
