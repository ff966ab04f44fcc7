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
4. the burst: ``FACTOR x capacity x --burst-s`` requests at evenly spaced arrivals through the
   router under test (and, with ``--compare-off``, the same burst through the other router once
   the worker is idle again).

Reports, per burst: the admitted requests' TTFT p50 / p90 / max against the unloaded TTFT, the
refusals (RESOURCE_EXHAUSTED: how many, by reason, their latency from send to status, the
Retry-After they carried), other errors, and the wall time. Every request has its own random
prompt (no prefix-cache hit). Prints a summary and the JSON (``--out`` writes it to a file).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
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
    ok = [r for r in records if r.success]
    refused = [r for r in records if r.code == "RESOURCE_EXHAUSTED"]
    others = Counter(r.status for r in records if not r.success and r.code != "RESOURCE_EXHAUSTED")
    reasons = Counter((m.group(1) if (m := _REASON.search(r.error)) else "?") for r in refused)
    retry = [int(m.group(1)) for r in refused if (m := _RETRY.search(r.error))]
    return {"sent": len(records), "admitted_ok": len(ok), "refused": len(refused), "other_errors": dict(others),
            "wall_s": round(wall_s, 2),
            "admitted_ttft": _ms([r.ttft() for r in ok]), "admitted_e2e": _ms([r.e2el() for r in ok]),
            "refusal_latency": _ms([r.e2el() for r in refused]), "refusal_reasons": dict(reasons),
            "retry_after_s": {"min": min(retry), "max": max(retry)} if retry else None}


def _burst(address: str, requests: list[BenchRequest], rate: float) -> dict:
    t0 = time.perf_counter()
    res = run_load(address, requests, [i / rate for i in range(len(requests))], timeout=600.0, channels_per_proc=4)
    return _summary(res.records, time.perf_counter() - t0)


def _second_router(dep: deployment.Deployment, model: str, args: list[str]) -> str:
    """A router with admission control off in front of the same workers (started, registered)."""
    port = free_port()
    svc = procs.router(port, decode=dep.decode, prefill=dep.prefill, model=model, log_dir=dep.log_dir,
                       extra=["--admission-slo-multiple", "0", *args])
    dep.services["router-off"] = svc.start()
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
    dep.wait_whole(dep.decode[0], tries=6000)


def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="overload-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    extra = args.router_args.split()
    dep = deployment.start(log_dir, model=args.model, device=args.device, num_prefill=0, num_decode=1,
                           decode_role="both", kv_memory_gb=args.kv_memory_gb, router_args=extra)
    try:
        off = _second_router(dep, args.model, _without_admission(extra))
        mk = lambda n: _requests(n, args.prompt_len, args.output_len, rng)    # noqa: E731
        run_load(off, mk(args.warmup), [0.0] * args.warmup, max_concurrency=1)
        unloaded = run_load(off, mk(args.unloaded), [0.0] * args.unloaded, max_concurrency=1)
        unloaded_ttft = [r.ttft() for r in unloaded.records if r.success]
        cap = run_load(off, mk(args.capacity_requests), [0.0] * args.capacity_requests,
                       max_concurrency=args.capacity_concurrency)
        done = [r for r in cap.records if r.success]
        capacity = len(done) / cap.duration
        rate = args.factor * capacity
        n = max(1, math.ceil(rate * args.burst_s))
        burst = mk(n)
        _wait_idle(dep)
        result: dict = {
            "config": vars(args), "log_dir": str(log_dir),
            "unloaded_ttft": _ms(unloaded_ttft),
            "capacity": {"req_per_s": round(capacity, 3), "completed": len(done),
                         "failed": dict(Counter(r.status for r in cap.records if not r.success)),
                         "ttft_under_saturation": _ms([r.ttft() for r in done])},
            "burst": {"rate_req_per_s": round(rate, 2), "requests": n, "duration_s": args.burst_s},
        }
        logger.info("capacity %.2f req/s; burst of %d requests at %.1f req/s", capacity, n, rate)
        result["admission_on"] = _burst(dep.router, burst, rate)
        if args.compare_off:
            _wait_idle(dep)
            result["admission_off"] = _burst(off, burst, rate)
        _wait_idle(dep)
        return result
    finally:
        dep.stop()


def _print(result: dict) -> None:
    u = result["unloaded_ttft"]
    print(f"unloaded TTFT p50 {u['p50_ms']} ms, p90 {u['p90_ms']} ms ({u['n']} requests)")
    c = result["capacity"]
    print(f"capacity {c['req_per_s']} req/s (closed loop, {c['completed']} completed, failed {c['failed'] or 'none'}; "
          f"TTFT p90 there {c['ttft_under_saturation']['p90_ms']} ms)")
    b = result["burst"]
    print(f"burst: {b['requests']} requests at {b['rate_req_per_s']} req/s over {b['duration_s']} s "
          f"({result['config']['factor']}x capacity)")
    for name in ("admission_on", "admission_off"):
        s = result.get(name)
        if s is None:
            continue
        t, lat = s["admitted_ttft"], s["refusal_latency"]
        print(f"  {name}: {s['admitted_ok']} admitted and completed, {s['refused']} refused "
              f"{s['refusal_reasons'] or ''}, other errors {s['other_errors'] or 'none'}; wall {s['wall_s']} s")
        print(f"    admitted TTFT p50 {t['p50_ms']} ms, p90 {t['p90_ms']} ms, max {t['max_ms']} ms "
              f"(p90 {t['p90_ms'] / u['p90_ms']:.1f}x unloaded)" if t["n"] else "    nothing admitted")
        if lat["n"]:
            print(f"    refusals answered in p50 {lat['p50_ms']} ms, p90 {lat['p90_ms']} ms, max {lat['max_ms']} ms; "
                  f"Retry-After {s['retry_after_s']}")


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
