"""PNGs of the scale simulation's JSON (bench/scale_sim.py): policies side by side, router cost
against the worker count, hit rate over time in the churn run."""
from __future__ import annotations

import json
from pathlib import Path

from pdserve.loadtest.plots import _plt

POLICY_ORDER = ("kv", "oracle", "least-loaded", "round-robin")


def plot_compare(data: dict, path: Path) -> None:
    plt = _plt()
    res = data["results"]
    workloads = sorted({r["workload"] for r in res})
    panels = (("prefill_hit_rate", "prefix-cache hit rate (prefill)"),
              ("decode_hit_rate", "prefix-cache hit rate (decode)"), ("p50_ttft_ms", "TTFT p50 (ms)"),
              ("p90_ttft_ms", "TTFT p90 (ms)"), ("imbalance", "decode load max/mean"))
    fig, axes = plt.subplots(1, len(panels), figsize=(22, 4.2))
    width = 0.8 / len(POLICY_ORDER)
    for ax, (key, label) in zip(axes, panels):
        for j, pol in enumerate(POLICY_ORDER):
            vals = []
            for w in workloads:
                r = next((x for x in res if x["workload"] == w and x.get("policy") == pol), None)
                v = None if r is None else (r[key]["mean"] if key == "imbalance" else r[key])
                vals.append(v or 0.0)
            ax.bar([i + j * width for i in range(len(workloads))], vals, width, label=pol)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
        ax.set_title(label)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("64 decode + 16 prefill simulated workers, 2 router replicas: routing policies")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_scaling(data: dict, path: Path) -> None:
    plt = _plt()
    res = data["results"]
    n = [r["num_decode"] for r in res]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.plot(n, [r["router_cpu_ms_per_request"] for r in res], "o-", label="total")
    a1.plot(n, [r["router_cpu_ms_per_request_net_of_idle"] for r in res], "s--", label="net of idle polling")
    a1.set_ylabel("router CPU ms per request (2 replicas)")
    a2.plot(n, [r["decision_p50_us"] for r in res], "o-", label="p50")
    a2.plot(n, [r["decision_p99_us"] for r in res], "s-", label="p99")
    a2.axhline(200, color="gray", ls=":", label="target p99 200 us")
    a2.set_ylabel("routing decision time (us)")
    for ax in (a1, a2):
        ax.set_xlabel("decode workers (prefill = decode / 4)")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_churn(data: dict, path: Path) -> None:
    plt = _plt()
    r = data["result"]
    t = [x[0] for x in r["hit_rate_timeline"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(t, [x[1] for x in r["hit_rate_timeline"]], "o-", label="prefill hit rate (per 2 s sample)")
    for when, what in r["events"]:
        ax.axvline(when, color="red" if what.startswith("killed") else "green", alpha=0.4)
    ax.set_xlabel("s since the sampler started (red: killed, green: started)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_all(out: Path) -> None:
    for name, fn in (("compare", plot_compare), ("scaling", plot_scaling), ("churn", plot_churn)):
        f = out / f"{name}.json"
        if f.exists():
            fn(json.loads(f.read_text()), out / f"{name}.png")
