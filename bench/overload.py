"""Overload: a burst at FACTOR x the deployment's measured capacity, through the router's
admission control (pdserve/router/admission.py); with ``--compare-off`` also through a router
without it, in front of the same worker.

    python -m bench.overload                                   # embedded model, CPU, defaults
    python -m bench.overload --device cuda --model qwen3-0.6b --prompt-len 1024 --compare-off

Processes on loopback (bench.deployment): one worker of role both, the router under test
(admission control as its defaults, or ``--router-args``) and a second router with every bound
off (``--admission-slo-multiple 0``), both in front of the worker. Through the second one:

1. warm-up (``--warmup`` requests);
2. unloaded TTFT: ``--unloaded`` requests, one at a time;
3. capacity: ``--capacity-requests`` requests with ``--capacity-concurrency`` in flight,
   completed per second (closed loop: the worker saturated, nothing refused);

then, each once the worker is idle again:

4. the burst: ``FACTOR x capacity x --burst-s`` requests at evenly spaced arrivals through the
   router under test (``admission_on``); with ``--compare-off`` the same burst through the
   second router (``admission_off``); with ``--objective-x-unloaded X`` (2; 0 = not) the same
   burst through a third router, the router under test's flags plus ``--slo-ttft-ms`` = X times
   the unloaded TTFT p90 (``admission_objective``: admission control bounds the TTFT by the
   objective, so this is the run where the objective is the issue's "2x unloaded");
5. light load: ``--light-requests`` requests at ``--light-factor x capacity``, evenly spaced,
   through the router under test (``light``; 0 = skipped).

Reports, per run: the admitted requests' TTFT p50 / p90 / max against the unloaded TTFT, the
refusals (RESOURCE_EXHAUSTED: how many, by reason, their latency from send to status, the
Retry-After they carried, and how many the router counted in
``pdserve_router_requests_refused_total``), other errors, the wall time, the seconds until the
worker's pool was whole again after it, and the machine's load average (the CPU may be shared).
Every request has its own random prompt (no prefix-cache hit). The checks of issue 41's
overload point (``checks``), per admission-controlled burst: admitted TTFT p90 within
``--max-ttft-ratio`` (2) x the unloaded p90, every refusal answered within ``--max-refusal-ms``
(50), no other error, every refusal counted by the router; and the pool whole after each run,
nothing refused at light load. Prints a summary and the JSON (``--out`` writes it to a file).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from bench import deployment
from pdserve.loadtest import procs
from pdserve.loadtest.client import run_load
from pdserve.loadtest.datasets import BenchRequest
from pdserve.loadtest.metrics import RequestRecord
from pdserve.loadtest.ports import free_port

logger = logging.getLogger(__name__)
_REASON = re.compile(r"overloaded \(([a-z-]+)\)")
_RETRY = re.compile(r"retry after (\d+) s")
WHOLE_TIMEOUT_S = 120.0     # after a run, the pool must be whole within this (else: leaked)


def _requests(n: int, prompt_len: int, output_len: int, rng: random.Random) -> list[BenchRequest]:
    return [BenchRequest(prompt_len, output_len, token_ids=[rng.randrange(100, 40000) for _ in range(prompt_len)])
            for _ in range(n)]


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000, 1) if values else None


def _ms(values: list[float]) -> dict:
    """p50 / p90 / max in milliseconds."""
    return {"n": len(values), "p50_ms": _pct(values, 50), "p90_ms": _pct(values, 90),
            "max_ms": round(max(values) * 1000, 1) if values else None}


def _summary(records: list[RequestRecord], wall_s: float) -> dict:
    """The run's figures; ``admitted``: each admitted request's send time (s from the first send),
    TTFT and end-to-end latency (ms); ``refusals``: each refused one's send time and latency."""
    ok = [r for r in records if r.success]
    t0 = min((r.send_time for r in records), default=0.0)
    refused = [r for r in records if r.code == "RESOURCE_EXHAUSTED"]
    others = Counter(r.status for r in records if not r.success and r.code != "RESOURCE_EXHAUSTED")
    reasons = Counter((m.group(1) if (m := _REASON.search(r.error)) else "?") for r in refused)
    retry = [int(m.group(1)) for r in refused if (m := _RETRY.search(r.error))]
    return {"sent": len(records), "admitted_ok": len(ok), "refused": len(refused), "other_errors": dict(others),
            "wall_s": round(wall_s, 2),
            "admitted_ttft": _ms([r.ttft() for r in ok]), "admitted_e2e": _ms([r.e2el() for r in ok]),
            "refusal_latency": _ms([r.e2el() for r in refused]), "refusal_reasons": dict(reasons),
            "retry_after_s": {"min": min(retry), "max": max(retry)} if retry else None,
            "admitted": [[round(r.send_time - t0, 3), round(r.ttft() * 1000, 1), round(r.e2el() * 1000, 1)]
                         for r in ok],
            "refusals": [[round(r.send_time - t0, 3), round(r.e2el() * 1000, 1)] for r in refused]}


def _refusals_counted(dep: deployment.Deployment, router: str) -> float:
    """Router ``router``'s ``pdserve_router_requests_refused_total``, all reasons."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in dep.scrape(router).splitlines()
               if line.startswith("pdserve_router_requests_refused_total{"))


def _burst(dep: deployment.Deployment, router: str, requests: list[BenchRequest], rate: float) -> dict:
    """``requests`` at evenly spaced arrivals through router ``router`` (a name of ``dep.services``);
    then the pool's wait to be whole."""
    address = dep.router if router == "router" else dep.services[router].address
    counted, load = _refusals_counted(dep, router), os.getloadavg()[0]
    t0 = time.perf_counter()
    res = run_load(address, requests, [i / rate for i in range(len(requests))], timeout=600.0, channels_per_proc=4)
    out = _summary(res.records, time.perf_counter() - t0)
    t1 = time.perf_counter()
    try:
        _wait_idle(dep)
        whole: float | None = round(time.perf_counter() - t1, 2)
    except AssertionError as e:         # not whole within WHOLE_TIMEOUT_S: a leak
        logger.error("%s", e)
        whole = None
    out.update(rate_req_per_s=round(rate, 3), whole_after_s=whole,
               refusals_counted=_refusals_counted(dep, router) - counted,
               loadavg_1m={"before": round(load, 2), "after": round(os.getloadavg()[0], 2)})
    return out


def _router(dep: deployment.Deployment, model: str, name: str, args: list[str]) -> str:
    """Another router, ``name``, in front of the same workers with its /metrics on a port of its
    own (started, registered); its address."""
    port, metrics_port = free_port(), free_port()
    svc = procs.router(port, decode=dep.decode, prefill=dep.prefill, model=model, log_dir=dep.log_dir,
                       extra=[*args, "--metrics-port", str(metrics_port)])
    dep.services[name] = svc.start()
    dep.metrics[name] = f"127.0.0.1:{metrics_port}"
    procs.wait_started([svc], svc.address, 0, 1, 240.0)
    return svc.address


def _without_admission(router_args: list[str]) -> list[str]:
    """The router flags minus the admission bounds (each given as ``--flag value``)."""
    bounds = {"--max-queued-prompt-tokens", "--max-waiting-requests", "--admission-slo-multiple"}
    out, skip = [], False
    for a in router_args:
        if skip:
            skip = False
        elif a in bounds:
            skip = True
        elif a.split("=", 1)[0] not in bounds:
            out.append(a)
    return out


def _wait_idle(dep: deployment.Deployment) -> None:
    """Until the worker's pool is whole and nothing is in flight there (AssertionError after WHOLE_TIMEOUT_S)."""
    dep.wait_whole(dep.decode[0], tries=int(WHOLE_TIMEOUT_S * 10))


def _measure(off: str, args: argparse.Namespace, mk) -> tuple[dict, float]:
    """Warm-up, unloaded TTFT and capacity through the router without admission control: their
    figures, and the capacity in requests/s."""
    load = os.getloadavg()[0]
    run_load(off, mk(args.warmup), [0.0] * args.warmup, max_concurrency=1)
    unloaded = run_load(off, mk(args.unloaded), [0.0] * args.unloaded, max_concurrency=1)
    cap = run_load(off, mk(args.capacity_requests), [0.0] * args.capacity_requests,
                   max_concurrency=args.capacity_concurrency)
    done = [r for r in cap.records if r.success]
    capacity = len(done) / cap.duration
    return {"unloaded_ttft": _ms([r.ttft() for r in unloaded.records if r.success]),
            "capacity": {"req_per_s": round(capacity, 3), "completed": len(done),
                         "failed": dict(Counter(r.status for r in cap.records if not r.success)),
                         "ttft_under_saturation": _ms([r.ttft() for r in done])},
            "loadavg_1m": {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)}}, capacity


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="overload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = args.router_args.split()
    dep = deployment.start(log_dir, model=args.model, device=args.device, num_prefill=0, num_decode=1,
                           decode_role="both", kv_memory_gb=args.kv_memory_gb, router_args=extra, metrics=True)
    try:
        off = _router(dep, args.model, "router-off", ["--admission-slo-multiple", "0", *_without_admission(extra)])
        mk = lambda n: _requests(n, args.prompt_len, args.output_len, rng)    # noqa: E731
        measured, capacity = _measure(off, args, mk)
        rate = args.factor * capacity
        n = max(1, math.ceil(rate * args.burst_s))
        burst = mk(n)
        _wait_idle(dep)
        result: dict = {"config": vars(args), "log_dir": str(log_dir), **measured,
                        "burst": {"rate_req_per_s": round(rate, 2), "requests": n, "duration_s": args.burst_s}}
        logger.info("capacity %.2f req/s; burst of %d requests at %.1f req/s", capacity, n, rate)
        result["admission_on"] = _burst(dep, "router", burst, rate)
        if args.compare_off:
            result["admission_off"] = _burst(dep, "router-off", burst, rate)
        if args.objective_x_unloaded > 0:
            slo = round(args.objective_x_unloaded * result["unloaded_ttft"]["p90_ms"])
            _router(dep, args.model, "router-objective", [*extra, "--slo-ttft-ms", str(slo)])
            result["admission_objective"] = {"slo_ttft_ms": slo, **_burst(dep, "router-objective", burst, rate)}
        if args.light_factor > 0 and args.light_requests > 0:
            result["light"] = _burst(dep, "router", mk(args.light_requests), args.light_factor * capacity)
        result["checks"] = _checks(result, args)
        return result
    finally:
        dep.stop()


def _ratio_checks(run: dict | None, unloaded_p90: float, args: argparse.Namespace) -> dict:
    """One burst's checks: admitted TTFT p90 / unloaded p90 (within ``--max-ttft-ratio``), the
    slowest refusal (within ``--max-refusal-ms``), nothing failed otherwise, refusals counted."""
    if run is None:
        return {}
    p90, slowest = run["admitted_ttft"]["p90_ms"], run["refusal_latency"]["max_ms"]
    ratio = p90 / unloaded_p90 if p90 is not None and unloaded_p90 else None
    return {"admitted_ttft_p90_ratio": None if ratio is None else round(ratio, 2),
            "admitted_ttft_within_ratio": None if ratio is None else ratio <= args.max_ttft_ratio,
            "refusals_within_ms": None if slowest is None else slowest < args.max_refusal_ms,
            "no_other_errors": not run["other_errors"],
            "refusals_counted_by_router": run["refusals_counted"] == run["refused"]}


def _checks(result: dict, args: argparse.Namespace) -> dict:
    """Issue 41's overload point, each check true or false (None: nothing to judge): per burst
    through a router with admission control (the default objective, and the objective of
    ``--objective-x-unloaded``), the pool whole after every run, nothing refused at light load."""
    unloaded_p90, light = result["unloaded_ttft"]["p90_ms"], result.get("light")
    runs = [r for k, r in result.items() if k in ("admission_on", "admission_off", "admission_objective", "light")]
    return {"default_objective": _ratio_checks(result["admission_on"], unloaded_p90, args),
            "objective_x_unloaded": _ratio_checks(result.get("admission_objective"), unloaded_p90, args),
            "pool_whole_after_each_run": all(r["whole_after_s"] is not None for r in runs),
            "light_load_refuses_nothing": None if light is None
            else light["refused"] == 0 and not light["other_errors"]}


def _print_run(name: str, s: dict, unloaded_p90: float) -> None:
    t, lat = s["admitted_ttft"], s["refusal_latency"]
    print(f"  {name}: {s['sent']} at {s['rate_req_per_s']} req/s: {s['admitted_ok']} admitted and completed, "
          f"{s['refused']} refused {s['refusal_reasons'] or ''} (router counted {s['refusals_counted']:g}), "
          f"other errors {s['other_errors'] or 'none'}; wall {s['wall_s']} s, pool whole {s['whole_after_s']} s "
          f"after; load average {s['loadavg_1m']['before']} -> {s['loadavg_1m']['after']}")
    print(f"    admitted TTFT p50 {t['p50_ms']} ms, p90 {t['p90_ms']} ms, max {t['max_ms']} ms "
          f"(p90 {t['p90_ms'] / unloaded_p90:.2f}x unloaded)" if t["n"] else "    nothing admitted")
    if lat["n"]:
        print(f"    refusals answered in p50 {lat['p50_ms']} ms, p90 {lat['p90_ms']} ms, max {lat['max_ms']} ms; "
              f"Retry-After {s['retry_after_s']}")


def _print(result: dict) -> None:
    u = result["unloaded_ttft"]
    print(f"unloaded TTFT p50 {u['p50_ms']} ms, p90 {u['p90_ms']} ms ({u['n']} requests); "
          f"load average {result['loadavg_1m']['before']} -> {result['loadavg_1m']['after']}")
    c = result["capacity"]
    print(f"capacity {c['req_per_s']} req/s (closed loop, {c['completed']} completed, failed {c['failed'] or 'none'}; "
          f"TTFT p90 there {c['ttft_under_saturation']['p90_ms']} ms)")
    b = result["burst"]
    print(f"burst: {b['requests']} requests at {b['rate_req_per_s']} req/s over {b['duration_s']} s "
          f"({result['config']['factor']}x capacity)")
    for name in ("admission_on", "admission_off", "admission_objective", "light"):
        if result.get(name) is not None:
            slo = result[name].get("slo_ttft_ms")
            _print_run(name + (f" (--slo-ttft-ms {slo})" if slo else ""), result[name], u["p90_ms"])
    print("checks:", json.dumps(result["checks"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-memory-gb", type=float, default=0.5)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--factor", type=float, default=10.0, help="burst rate / measured capacity")
    p.add_argument("--burst-s", type=float, default=5.0, help="how long the burst's arrivals last")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--unloaded", type=int, default=10)
    p.add_argument("--capacity-requests", type=int, default=24)
    p.add_argument("--capacity-concurrency", type=int, default=6)
    p.add_argument("--objective-x-unloaded", type=float, default=2.0,
                   help="also send the burst through a router whose TTFT objective (--slo-ttft-ms) is this many "
                        "times the measured unloaded TTFT p90, admission control as the router under test's "
                        "(0 = not)")
    p.add_argument("--light-factor", type=float, default=0.3, help="light load's rate / measured capacity "
                                                                  "(0 = no light-load run)")
    p.add_argument("--light-requests", type=int, default=12, help="requests of the light-load run")
    p.add_argument("--max-ttft-ratio", type=float, default=2.0, help="check: admitted TTFT p90 / unloaded p90")
    p.add_argument("--max-refusal-ms", type=float, default=50.0, help="check: the slowest refusal's answer")
    p.add_argument("--router-args", default="", help="flags of the router under test, as one string "
                                                      "(e.g. '--slo-ttft-ms 500 --max-waiting-requests 8')")
    p.add_argument("--compare-off", action="store_true", help="also send the burst through a router without "
                                                               "admission control")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", default="")
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run(args)
    _print(result)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
