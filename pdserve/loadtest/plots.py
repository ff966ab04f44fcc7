"""PNG plots of serving runs (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

LATENCIES = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("e2el", "E2E latency (ms)"))


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def rate_str(rate: Any) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def point_label(res: dict[str, Any], vary_concurrency: bool = False) -> str:
    rate = rate_str(res.get("request_rate"))
    conc = res.get("max_concurrency")
    if vary_concurrency:
        return f"conc {conc}" + ("" if rate == "inf" else f" @ {rate}/s")
    return f"{rate} req/s" + (f", conc {conc}" if conc else "")


def latency_cdfs(samples: Sequence[tuple[str, dict[str, list[float]]]], path: str | Path, title: str = "") -> Path:
    """One panel per latency (TTFT, TPOT, E2E): the empirical CDF of each labelled run."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, (key, xlabel) in zip(axes, LATENCIES):
        wide = False
        for label, s in samples:
            v = np.sort(np.asarray(s.get(key, []), dtype=float))
            if v.size == 0:
                continue
            y = np.arange(1, v.size + 1) / v.size
            ax.step(v, y, where="post", label=label)
            wide = wide or (v[0] > 0 and v[-1] / v[0] > 50)
        if wide:
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.01)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    return _save(plt, fig, path, title)


def throughput_vs_rate(results: Sequence[dict[str, Any]], path: str | Path, title: str = "",
                       vary_concurrency: bool = False) -> Path:
    """Output tokens/s, and requests/s (throughput, goodput) against the offered load."""
    plt = _plt()
    labels = [point_label(r, vary_concurrency).replace(" req/s", "") for r in results]
    x = np.arange(len(results))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    a1.plot(x, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    a1.plot(x, [r["total_token_throughput"] for r in results], "s--", label="total tok/s")
    a1.set_ylabel("tokens / s")
    a2.plot(x, [r["request_throughput"] for r in results], "o-", label="throughput")
    if any(r.get("request_goodput") is not None for r in results):
        a2.plot(x, [r.get("request_goodput") or 0.0 for r in results], "s-", label="goodput (all SLOs met)")
    offered = [float(r["request_rate"]) for r in results if r["request_rate"] != "inf"]
    if offered and not vary_concurrency:
        a2.plot(x[:len(offered)], offered, "x:", color="gray", label="offered rate")
    a2.set_ylabel("requests / s")
    for ax in (a1, a2):
        ax.set_xticks(x, labels)
        ax.set_xlabel("max concurrency" if vary_concurrency else "request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, title)


def goodput_compare(series: Sequence[tuple[str, Sequence[dict[str, Any]]]], path: str | Path, title: str = "",
                    metric: str = "request_goodput") -> Path:
    """``metric`` (goodput by default; throughput where no SLO was set) against rate, one line per config."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    labels: list[str] = []
    for name, results in series:
        labels = [rate_str(r["request_rate"]) for r in results] if len(results) > len(labels) else labels
        x = np.arange(len(results))
        a1.plot(x, [r.get(metric) or 0.0 for r in results], "o-", label=name)
        a2.plot(x, [r["output_throughput"] for r in results], "o-", label=name)
    a1.set_ylabel("goodput (req/s meeting SLOs)" if metric == "request_goodput" else metric)
    a2.set_ylabel("output tokens / s")
    for ax in (a1, a2):
        ax.set_xticks(np.arange(len(labels)), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return _save(plt, fig, path, title)


def capacity_compare(rows: Sequence[tuple[str, Any]], path: str | Path, title: str = "",
                     min_attainment: float = 0.9) -> Path:
    """SLO capacity per deployment (bars; hatched where it is only a lower bound) and each run's
    SLO attainment against its rate (the bisection's points)."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [name for name, _ in rows]
    for i, (name, cap) in enumerate(rows):
        a1.bar(i, cap.capacity, hatch="" if cap.bounded else "//", edgecolor="black")
        a1.annotate(f"{cap.capacity:g}", (i, cap.capacity), ha="center", va="bottom", fontsize=9)
        pts = sorted(cap.points, key=lambda p: p["rate"])
        a2.plot([p["rate"] for p in pts], [p.get("slo_attainment", 0.0) for p in pts], "o-", label=name)
    a1.set_xticks(np.arange(len(names)), names)
    a1.set_ylabel("SLO capacity (req/s)")
    a2.axhline(min_attainment, color="gray", linestyle=":", label=f"{min_attainment:.0%}")
    a2.set_xlabel("request rate (req/s)")
    a2.set_ylabel("SLO attainment")
    a2.set_ylim(0, 1.02)
    a2.legend(fontsize=8)
    for ax in (a1, a2):
        ax.grid(True, alpha=0.3)
    return _save(plt, fig, path, title)
