"""Scale simulation: real router replicas in front of 16 prefill + 64 decode simulated workers
(bench/sim: scripted gRPC workers with the engine's BlockManager and a modelled GPU), driven
by ``pdserve bench serve``; results as JSON + PNG (docs/benchmarks.md, "Scale simulation").

    python -m bench.scale_sim compare --out bench/results/scale_sim    # kv / oracle / least-loaded / round-robin
    python -m bench.scale_sim scaling --out bench/results/scale_sim    # router cost at 8..64 decode workers
    python -m bench.scale_sim churn --out bench/results/scale_sim      # 4 killed + 4 added mid-run
    python -m bench.scale_sim saturated --out bench/results/scale_sim --rate 3 --num-prompts 150   # imbalance, 8 decode
    python -m bench.scale_sim plot --out bench/results/scale_sim

Policies: ``kv`` (the router's default), ``oracle`` (kv with --load-alpha 0: always the worker
holding the longest cached prefix, by the routers' exact index), ``least-loaded`` and
``round-robin``. Each case starts a fresh deployment (empty caches) and sends the same
requests (same seed) at the same times.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, replace
from pathlib import Path

from bench.sim import analysis
from bench.sim.cluster import Cluster, Sampler, SimConfig, get_stats
from pdserve.loadtest import procs

log = logging.getLogger("scale_sim")
POLICIES = {"kv": ("kv", 1.0), "oracle": ("kv", 0.0), "least-loaded": ("least-loaded", 1.0),
            "round-robin": ("round-robin", 1.0)}
WORKLOADS = {   # bench serve flags; rates are wall-clock requests/s of the time-scaled model
    "shared-prefix": ["--dataset", "shared-prefix", "--num-prefixes", "16", "--prefix-len", "1024",
                      "--input-len", "32:64", "--output-len", "16:32"],
    "multi-turn": ["--dataset", "multi-turn", "--num-turns", "6", "--num-prefixes", "4", "--prefix-len", "256",
                   "--input-len", "64:128", "--output-len", "64:128"],
    # the same conversations twice as long (12 turns): a conversation's history is most of its prompt
    "multi-turn-long": ["--dataset", "multi-turn", "--num-turns", "12", "--num-prefixes", "4", "--prefix-len", "256",
                        "--input-len", "64:128", "--output-len", "64:128"],
    # long outputs: ~10 requests run on each of 8 decode workers (the imbalance target's regime)
    "shared-prefix-long": ["--dataset", "shared-prefix", "--num-prefixes", "16", "--prefix-len", "1024",
                           "--input-len", "32:64", "--output-len", "256:512"],
}


for _name in ("multi-turn", "multi-turn-long"):     # each next turn sent once the previous one has ended
    WORKLOADS[f"{_name}-closed"] = [*WORKLOADS[_name], "--closed-loop-turns"]


def bench_serve(routers: str, workload: list[str], num: int, rate: float, tmp: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--router", routers, *workload,
           "--num-prompts", str(num), "--request-rate", str(rate), "--num-warmups", "0", "--disable-tqdm",
           "--no-plots", "--result-dir", str(tmp), "--result-filename", "run", "--request-timeout", "120",
           "--channels-per-proc", "4", "--save-detailed"]
    subprocess.run(cmd, cwd=procs.ROOT, env=procs._env(), check=False, stdout=subprocess.DEVNULL)
    return json.loads((tmp / "run.json").read_text())["results"][0]


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _start_cluster(cfg: SimConfig, log_dir: Path, tries: int = 3) -> Cluster:
    """A started deployment; a fresh one (new ports) when a process failed to start (free_ports()
    picks outside the ephemeral range, but another program may still take a port between the
    pick and the worker's bind)."""
    for i in range(tries):
        try:
            return Cluster(cfg, log_dir).start()
        except RuntimeError as e:
            if i == tries - 1:
                raise
            log.warning("deployment failed to start (%s); again with new ports", str(e).splitlines()[0])
    raise AssertionError("unreachable")


def run_case(cfg: SimConfig, workload: str, num: int, rate: float, log_dir: Path, churn_at: float = 0.0) -> dict:
    """One deployment, one bench serve run; with ``churn_at`` > 0 the standalone workers are
    killed and the late ones started that many seconds into the run."""
    cluster = _start_cluster(cfg, log_dir)
    try:
        sampler = Sampler(cluster.decode + cluster.decode_late + cluster.prefill + cluster.prefill_late, interval=2.0)
        idle0 = [procs.cpu_seconds(r.pid) for r in cluster.routers]
        time.sleep(5.0)
        idle1 = [procs.cpu_seconds(r.pid) for r in cluster.routers]
        events: list[tuple[float, str]] = []
        if churn_at > 0:
            threading.Thread(target=_churn, args=(cluster, churn_at, sampler, events), daemon=True).start()
        sampler.start()
        with tempfile.TemporaryDirectory() as tmp:
            res = bench_serve(cluster.router_addresses, WORKLOADS[workload], num, rate, Path(tmp))
        cpu = [procs.cpu_seconds(r.pid) for r in cluster.routers]
        sampler.stop()
        texts = [_scrape(p) for p in cluster.metrics_ports()]
    finally:
        cluster.stop()
    idle_rate = sum(b - a for a, b in zip(idle0, idle1)) / 5.0
    busy = sum(c - b for b, c in zip(idle1, cpu))
    n = max(1, res["num_requests"])
    buckets = analysis.merge_buckets([analysis.decision_buckets(t) for t in texts])
    detailed = res.pop("detailed", None) or {}
    samples = sampler.samples
    decode_live, prefill_live = cluster.decode + cluster.decode_late, cluster.prefill + cluster.prefill_late
    return {
        "workload": workload, "config": asdict(cfg), "num_requests": res["num_requests"], "rate": rate,
        "completed": res["completed"], "failed": res["failed"], "error_counts": res["error_counts"],
        "duration_s": res["duration"], "p50_ttft_ms": res["p50_ttft_ms"], "p90_ttft_ms": res["p90_ttft_ms"],
        "p99_ttft_ms": res["p99_ttft_ms"], "median_e2el_ms": res["median_e2el_ms"],
        "median_tpot_ms": res.get("median_tpot_ms"), "p90_tpot_ms": res.get("p90_tpot_ms"),
        "client_cached_fraction": res["total_cached_tokens"] / max(1, res["total_input_tokens"]),
        "prefill_hit_rate": analysis.hit_rate(samples, prefill_live),
        "decode_hit_rate": analysis.hit_rate(samples, decode_live),
        "imbalance": analysis.imbalance(samples, decode_live),
        "channels": analysis.channel_counts(samples, cluster.prefill),
        "router_cpu_ms_per_request": 1000 * busy / n,
        "router_idle_cpu_cores": idle_rate,
        "router_cpu_ms_per_request_net_of_idle": 1000 * max(0.0, busy - idle_rate * res["duration"]) / n,
        "decision_p50_us": 1e6 * analysis.histogram_quantile(buckets, 0.5),
        "decision_p99_us": 1e6 * analysis.histogram_quantile(buckets, 0.99),
        "hit_rate_timeline": analysis.hit_rate_timeline(samples, prefill_live),
        "events": events,
        "migrations": sum(analysis.counter_total(t, "pdserve_router_migrations") for t in texts),
        "retries": sum(analysis.counter_total(t, "pdserve_router_retries") for t in texts),
        "ttft_by_turn": (analysis.ttft_by_turn(detailed["ttfts"], [e["turn"] for e in detailed["extra"]])
                         if workload.startswith("multi-turn") and detailed else None),
    }


KILLED_DECODE = 2      # churn: the busiest standalone decode workers are killed (all standalone prefill ones)


def _churn(cluster: Cluster, at: float, sampler: Sampler, events: list) -> None:
    time.sleep(at)
    for addr in _victims(cluster):
        cluster.single[addr].proc.kill()
        events.append((time.monotonic() - sampler.t0, f"killed {addr}"))
    for addr, svc in cluster.late.items():
        svc.start()
        events.append((time.monotonic() - sampler.t0, f"started {addr}"))


def _victims(cluster: Cluster) -> list[str]:
    """The ``KILLED_DECODE`` standalone decode workers running the most requests now (so that
    streams are cut mid-way) and every standalone prefill worker."""
    decode = [a for a in cluster.single if a in cluster.decode]
    running = {a: (s.num_running if (s := get_stats(a)) is not None else -1) for a in decode}
    busiest = sorted(decode, key=lambda a: -running[a])[:KILLED_DECODE]
    return busiest + [a for a in cluster.single if a in cluster.prefill]


def _save(out: Path, name: str, payload) -> None:
    out.mkdir(parents=True, exist_ok=True)
    payload = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
               "command": " ".join(["python -m bench.scale_sim", *sys.argv[1:]]), **payload}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1, default=str))


def compare(args: argparse.Namespace) -> None:
    base = SimConfig(time_scale=args.time_scale, prefill_blocks=args.prefill_blocks, decode_blocks=args.decode_blocks)
    results = []
    for workload in args.workloads.split(","):
        for name in args.policies.split(","):
            routing, alpha = POLICIES[name]
            cfg = replace(base, routing=routing, load_alpha=alpha)
            log.info("compare: %s / %s", workload, name)
            r = run_case(cfg, workload, args.num_prompts, args.rate, args.log_dir)
            r["policy"] = name
            results.append(r)
            _save(args.out, "compare", {"commit": _commit(), "results": results})


def scaling(args: argparse.Namespace) -> None:
    results = []
    for n in (8, 16, 32, 64):
        cfg = SimConfig(num_decode=n, num_prefill=max(2, n // 4), time_scale=args.time_scale,
                        prefill_blocks=args.prefill_blocks, decode_blocks=args.decode_blocks)
        log.info("scaling: %d decode workers", n)
        r = run_case(cfg, "shared-prefix", args.num_prompts, args.rate, args.log_dir)
        r["num_decode"], r["num_prefill"] = n, cfg.num_prefill
        r.pop("hit_rate_timeline", None)
        results.append(r)
        _save(args.out, "scaling", {"commit": _commit(), "results": results})


def saturated(args: argparse.Namespace) -> None:
    """Load imbalance where it can be small: 8 decode + 2 prefill workers, outputs of 256-512
    tokens, so that many requests run on every decode worker at once (max/mean of a sample with
    fewer requests than workers is >= 2 whatever the policy: see analysis.imbalance)."""
    base = SimConfig(num_decode=8, num_prefill=2, time_scale=args.time_scale, prefill_blocks=args.prefill_blocks,
                     decode_blocks=args.decode_blocks)
    results = []
    for name in args.policies.split(","):
        routing, alpha = POLICIES[name]
        log.info("saturated: %s", name)
        r = run_case(replace(base, routing=routing, load_alpha=alpha), "shared-prefix-long", args.num_prompts,
                     args.rate, args.log_dir)
        r["policy"] = name
        r.pop("hit_rate_timeline", None)
        results.append(r)
        _save(args.out, "saturated", {"commit": _commit(), "results": results})


def churn(args: argparse.Namespace) -> None:
    cfg = SimConfig(time_scale=args.time_scale, prefill_blocks=args.prefill_blocks, decode_blocks=args.decode_blocks,
                    standalone_decode=4 * KILLED_DECODE, standalone_prefill=2, late_decode=2, late_prefill=2)
    r = run_case(cfg, args.churn_workload, args.num_prompts, args.rate, args.log_dir, churn_at=args.churn_at)
    _save(args.out, "churn", {"commit": _commit(), "result": r})


def _commit() -> str:
    from pdserve.loadtest.runner import git_commit
    return git_commit()


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale_sim", description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("compare", "scaling", "churn", "saturated", "plot"))
    p.add_argument("--out", type=Path, default=Path("bench/results/scale_sim"))
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--num-prompts", type=int, default=600)
    p.add_argument("--rate", type=float, default=15.0, help="requests/s (wall clock)")
    p.add_argument("--time-scale", type=float, default=6.0, help="the modelled GPU runs this many times slower")
    p.add_argument("--workloads", default="shared-prefix,multi-turn")
    p.add_argument("--prefill-blocks", type=int, default=SimConfig.prefill_blocks,
                   help="KV pool of each simulated prefill worker, in blocks of 16 tokens")
    p.add_argument("--decode-blocks", type=int, default=SimConfig.decode_blocks,
                   help="KV pool of each simulated decode worker, in blocks of 16 tokens")
    p.add_argument("--policies", default="kv,oracle,least-loaded,round-robin")
    p.add_argument("--churn-at", type=float, default=20.0, help="churn: seconds into the run")
    p.add_argument("--churn-workload", default="shared-prefix", choices=sorted(WORKLOADS),
                   help="churn: the workload (shared-prefix-long: streams of 256-512 tokens, so that the "
                        "killed decode workers have streams in flight to migrate)")
    args = p.parse_args(argv)
    # SIGTERM (timeout(1), a killed job) / SIGHUP: exit through the finally clauses, so that the
    # deployment is stopped; by default Python dies at once and its routers and fleets, started
    # in sessions of their own, live on as orphans.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="scale_sim-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.what == "plot":
        from bench.sim.report import plot_all
        plot_all(args.out)
    else:
        {"compare": compare, "scaling": scaling, "churn": churn, "saturated": saturated}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
