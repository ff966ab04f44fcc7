"""The router alone, on this machine's CPU, in front of scripted workers (separate processes).

``latency``: sequential requests straight to the workers and through the router, interleaved;
the difference of the TTFT/E2E distributions (and of paired requests) is what the router adds,
with its CPU time per request from /proc net of idle use. ``fanout``: C concurrent streams on a
``both`` worker stepping every ``--fanout-step-ms``, tokens/s and messages/s delivered through
the router against the ideal and a direct subscriber, with each process's CPU use.
Writes ``--output`` (default router_overhead.json, in the working directory).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.loadtest import procs
from pdserve.loadtest.client import run_async, run_load
from pdserve.loadtest.datasets import BenchRequest
from pdserve.loadtest.metrics import compute_metrics
from pdserve.loadtest.ports import free_ports
from pdserve.loadtest.runner import git_commit, host_info

log = logging.getLogger(__name__)
PCTS = (50, 90, 99)


def _stats(values_ms: list[float]) -> dict[str, float]:
    v = np.asarray(values_ms, dtype=float)
    out = {"mean": float(v.mean()), "std": float(v.std())}
    out.update({f"p{p}": float(np.percentile(v, p)) for p in PCTS})
    return out


class DirectClient:
    """Plays the router's worker-facing part for one request at a time (no router in between)."""

    def __init__(self, decode: str, prefill: str | None = None) -> None:
        self.decode_addr, self.prefill_addr = decode, prefill
        self.router_id = f"bench-direct-{uuid.uuid4().hex[:6]}"
        self.queues: dict[str, asyncio.Queue] = {}

    async def __aenter__(self) -> DirectClient:
        import grpc

        from pdserve.v1 import worker_pb2, worker_pb2_grpc
        self._pb = worker_pb2
        self.dch = grpc.aio.insecure_channel(self.decode_addr)
        self.decode = worker_pb2_grpc.WorkerStub(self.dch)
        self.pch = grpc.aio.insecure_channel(self.prefill_addr) if self.prefill_addr else None
        self.prefill = worker_pb2_grpc.WorkerStub(self.pch) if self.pch else None
        self.sub = self.decode.Subscribe(worker_pb2.SubscribeRequest(router_id=self.router_id))
        await self.sub.initial_metadata()
        self.pump = asyncio.create_task(self._pump())
        return self

    async def __aexit__(self, *exc) -> None:
        self.sub.cancel()
        self.pump.cancel()
        await asyncio.gather(self.pump, return_exceptions=True)
        await self.dch.close()
        if self.pch is not None:
            await self.pch.close()

    async def _pump(self) -> None:
        async for step in self.sub:
            t = time.perf_counter()
            for out in step.outputs:
                q = self.queues.get(out.request_id)
                if q is not None:
                    q.put_nowait((t, out))

    async def request(self, ids: list[int], max_tokens: int) -> tuple[float, float]:
        """(TTFT, E2E) in seconds of one request."""
        from pdserve.v1 import common_pb2
        pb = self._pb
        rid = f"{self.router_id}-{uuid.uuid4().hex[:8]}"
        params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        # Build the first request message before the clock starts, as the routed client does; the
        # Prefill request copies the ids from it after Reserve, as the router does.
        if self.prefill is None:
            first_req = pb.SubmitRequest(request_id=rid, token_ids=ids, params=params, router_id=self.router_id)
        else:
            first_req = pb.ReserveRequest(request_id=rid, token_ids=ids, params=params, lease_ms=30_000,
                                          router_id=self.router_id)
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        ttft = None
        t0 = time.perf_counter()
        try:
            if self.prefill is None:
                await self.decode.Submit(first_req, timeout=10)
            else:
                res = await self.decode.Reserve(first_req, timeout=10)
                target = pb.KvTarget(decode_worker_id=res.worker_id, kv_store_address=res.kv_store_address,
                                     decode_address=self.decode_addr, block_ids=res.block_ids,
                                     num_cached_tokens=res.num_cached_tokens)
                call = self.prefill.Prefill(pb.PrefillRequest(request_id=rid, token_ids=first_req.token_ids,
                                                              params=params, kv_target=target), timeout=10)
                first = await call.read()
                ttft = time.perf_counter() - t0
                if first.first_token.finish_reason:
                    return ttft, ttft
                rest = asyncio.create_task(_drain(call))
            while True:
                t, out = await asyncio.wait_for(q.get(), 10)
                if out.token_ids and ttft is None:
                    ttft = t - t0
                if out.finish_reason:
                    if out.finish_reason not in (common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP):
                        reason = common_pb2.FinishReason.Name(out.finish_reason)
                        raise RuntimeError(f"direct request ended with {reason} {out.error}")
                    if self.prefill is not None:
                        await rest
                    return ttft if ttft is not None else t - t0, t - t0
        finally:
            self.queues.pop(rid, None)


async def _drain(call) -> None:
    import grpc
    while await call.read() is not grpc.aio.EOF:
        pass


async def _routed(stub, ids: list[int], max_tokens: int) -> tuple[float, float, int]:
    from pdserve.v1 import common_pb2, router_pb2
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                     params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    ttft = None
    n = 0
    async for msg in stub.Generate(req, timeout=10):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(msg.token_ids)
    if ttft is None:
        raise RuntimeError("routed request ended without a token")
    return ttft, time.perf_counter() - t0, n


async def _latency_pairs(router: str, decode: str, prefill: str | None, n: int, warm: int, prompt_len: int,
                         max_tokens: int, vocab: int, seed: int, router_svc: procs.Service,
                         idle_s: float = 3.0) -> dict[str, Any]:
    import grpc

    from pdserve.v1 import router_pb2_grpc
    rng = random.Random(seed)
    direct: dict[str, list[float]] = {"ttft": [], "e2e": []}
    routed: dict[str, list[float]] = {"ttft": [], "e2e": []}
    async with DirectClient(decode, prefill) as dc, grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        idle0, t_idle = router_svc.cpu_seconds(), time.perf_counter()
        await asyncio.sleep(idle_s)              # the router's CPU use with nothing to do (stats polls, ...)
        idle_cores = (router_svc.cpu_seconds() - idle0) / (time.perf_counter() - t_idle)
        cpu0 = wall0 = 0.0
        for i in range(warm + n):
            if i == warm:
                cpu0, wall0 = router_svc.cpu_seconds(), time.perf_counter()
            ids = [rng.randrange(vocab) for _ in range(prompt_len)]
            order = ("d", "r") if i % 2 == 0 else ("r", "d")
            for who in order:
                if who == "d":
                    ttft, e2e = await dc.request(ids, max_tokens)
                    dst = direct
                else:
                    ttft, e2e, got = await _routed(stub, ids, max_tokens)
                    if got != max_tokens:
                        raise RuntimeError(f"routed request returned {got} tokens, not {max_tokens}")
                    dst = routed
                if i >= warm:
                    dst["ttft"].append(ttft * 1000)
                    dst["e2e"].append(e2e * 1000)
        router_cpu = router_svc.cpu_seconds() - cpu0
        wall = time.perf_counter() - wall0
    out: dict[str, Any] = {"direct": {k: _stats(v) for k, v in direct.items()},
                           "router": {k: _stats(v) for k, v in routed.items()}}
    for k in ("ttft", "e2e"):
        d, r = out["direct"][k], out["router"][k]
        out[f"added_{k}_ms"] = {s: r[s] - d[s] for s in ("mean", "p50", "p90", "p99")}
        out[f"paired_added_{k}_ms"] = _stats([a - b for a, b in zip(routed[k], direct[k])])
    if max_tokens > 1:
        added_decode_ms = out["added_e2e_ms"]["mean"] - out["added_ttft_ms"]["mean"]
        out["added_per_output_token_ms"] = added_decode_ms / (max_tokens - 1)
    out["router_cpu_ms_per_request"] = router_cpu * 1000 / n
    out["router_idle_cpu_cores"] = idle_cores
    out["router_cpu_ms_per_request_net"] = max(0.0, router_cpu - idle_cores * wall) * 1000 / n
    out["router_cpu_util_during_phase"] = router_cpu / wall if wall > 0 else 0.0
    return out


def latency_benchmark(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for setup in [s.strip() for s in args.setups.split(",") if s.strip()]:
        if setup not in ("colocated", "disagg"):
            raise SystemExit(f"unknown setup {setup!r} (colocated, disagg)")
        ports = free_ports(3, 2)
        step = args.latency_step_ms
        if setup == "colocated":
            workers = [procs.scripted_worker(ports[0], "both", step_ms=step, prefill_ms=step, log_dir=log_dir)]
            decode, prefill = workers[0].address, None
        else:
            workers = [procs.scripted_worker(ports[0], "decode", step_ms=step, log_dir=log_dir),
                       procs.scripted_worker(ports[1], "prefill", step_ms=step, prefill_ms=step, log_dir=log_dir)]
            decode, prefill = workers[0].address, workers[1].address
        router = procs.router(ports[2], decode=[decode], prefill=[prefill] if prefill else [], model=args.model,
                              log_dir=log_dir)
        services = [w.start() for w in workers] + [router.start()]
        try:
            procs.wait_ready(services, 120)
            procs.wait_workers(router.address, 1, 1, 60)
            print(f"latency [{setup}]: {args.num_requests} x (direct, routed), prompt {args.prompt_len}, "
                  f"{args.latency_max_tokens} tokens, step {step} ms", flush=True)
            res = run_async(_latency_pairs(router.address, decode, prefill, args.num_requests,
                                             min(20, args.num_requests), args.prompt_len, args.latency_max_tokens,
                                             49152, 0, router, args.idle_measure_s))
            res.update({"workers": [w.cmd[2:] for w in workers], "router_cmd": router.cmd[2:]})
            results[setup] = res
            a, b = res["added_ttft_ms"], res["added_e2e_ms"]
            print(f"  added TTFT p50 {a['p50']:.3f} ms, p99 {a['p99']:.3f} ms; added E2E p50 {b['p50']:.3f} ms, "
                  f"p99 {b['p99']:.3f} ms; router CPU {res['router_cpu_ms_per_request']:.2f} ms/request "
                  f"({res['router_cpu_ms_per_request_net']:.2f} above its idle use)", flush=True)
        finally:
            procs.stop_all(services)
    return results


async def _direct_fanout(decode: str, reqs: list[BenchRequest], concurrency: int) -> tuple[float, int]:
    """The worker alone: ``reqs`` through a :class:`DirectClient`, ``concurrency`` at a time.
    (wall seconds, tokens); the ceiling the router is measured against."""
    sem = asyncio.Semaphore(concurrency)
    async with DirectClient(decode) as dc:
        async def one(r: BenchRequest) -> None:
            if r.token_ids is None:
                raise ValueError("the direct client sends token ids; the request has none")
            async with sem:
                await dc.request(r.token_ids, r.output_len)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(r) for r in reqs))
        return time.perf_counter() - t0, sum(r.output_len for r in reqs)


def fanout_benchmark(args: argparse.Namespace, log_dir: Path) -> list[dict[str, Any]]:
    concs = [int(c) for c in str(args.fanout_concurrency).split(",") if c.strip()]
    wport, rport = free_ports(2, 2)
    worker = procs.scripted_worker(wport, "both", step_ms=args.fanout_step_ms, num_blocks=262144,
                                   log_dir=log_dir)
    router = procs.router(rport, decode=[worker.address], model=args.model, log_dir=log_dir)
    services = [worker.start(), router.start()]
    out = []
    try:
        procs.wait_ready(services, 120)
        procs.wait_workers(router.address, 1, 1, 60)
        rng = random.Random(1)
        for c in concs:
            n = max(c, int(round(args.fanout_rounds * c)))
            reqs = [BenchRequest(32, args.fanout_max_tokens, token_ids=[rng.randrange(49152) for _ in range(32)])
                    for _ in range(n)]
            run_load(router.address, reqs[:min(c, 8)], [0.0] * min(c, 8), channels_per_proc=2)   # warm
            w_d0 = worker.cpu_seconds()
            d_wall, d_tokens = run_async(_direct_fanout(worker.address, reqs, c))
            direct_tps, direct_worker_cores = d_tokens / d_wall, (worker.cpu_seconds() - w_d0) / d_wall
            r0, w0 = router.cpu_seconds(), worker.cpu_seconds()
            load = run_load(router.address, reqs, [0.0] * n, max_concurrency=c, num_procs=args.num_client_procs,
                            timeout=600)
            r1, w1 = router.cpu_seconds(), worker.cpu_seconds()
            m = compute_metrics(load.records, load.duration)
            msgs = sum(1 for r in load.records for k in r.msg_tokens if k)
            ideal = c * 1000.0 / args.fanout_step_ms
            res = {"concurrency": c, "requests": n, "max_tokens": args.fanout_max_tokens,
                   "step_ms": args.fanout_step_ms, "duration_s": load.duration, "completed": m["completed"],
                   "failed": m["failed"], "error_counts": m["error_counts"],
                   "tokens_per_s": m["output_throughput"], "messages_per_s": msgs / load.duration,
                   "ideal_tokens_per_s": ideal, "fraction_of_ideal": m["output_throughput"] / ideal,
                   "direct_tokens_per_s": direct_tps, "direct_worker_cpu_cores": direct_worker_cores,
                   "fraction_of_direct": m["output_throughput"] / direct_tps,
                   "mean_tokens_per_message": m["mean_tokens_per_message"],
                   "mean_itl_ms": m["mean_itl_ms"], "p99_itl_ms": m["p99_itl_ms"],
                   "median_ttft_ms": m["median_ttft_ms"], "p99_ttft_ms": m["p99_ttft_ms"],
                   "router_cpu_s": r1 - r0, "router_cpu_cores": (r1 - r0) / load.duration,
                   "router_cpu_us_per_token": (r1 - r0) * 1e6 / max(1, m["total_output_tokens"]),
                   "worker_cpu_cores": (w1 - w0) / load.duration,
                   "client_cpu_cores": load.client["total_cpu_s"] / load.duration,
                   "client": load.client}
            out.append(res)
            print(f"fan-out C={c}: {res['tokens_per_s']:.0f} tok/s through the router, {direct_tps:.0f} direct "
                  f"({res['fraction_of_direct']:.0%}; ideal {ideal:.0f}), {res['messages_per_s']:.0f} msg/s, "
                  f"{res['mean_tokens_per_message']:.2f} tok/msg; "
                  f"router {res['router_cpu_cores']:.2f} cores ({res['router_cpu_us_per_token']:.1f} us/token), "
                  f"worker {res['worker_cpu_cores']:.2f}, client {res['client_cpu_cores']:.2f} cores", flush=True)
    finally:
        procs.stop_all(services)
    return out


def run_router_overhead(args: argparse.Namespace) -> int:
    """``pdserve bench router-overhead``."""
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="pdserve-router-overhead-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    payload: dict[str, Any] = {
        "benchmark": "pdserve bench router-overhead",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
        "commit": git_commit(), "host": host_info(),
        "config": {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_") and not callable(v)}}
    if not args.skip_latency:
        payload["latency"] = latency_benchmark(args, log_dir)
    if not args.skip_fanout:
        payload["fanout"] = fanout_benchmark(args, log_dir)
    payload["wall_s"] = time.time() - started
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    print(f"results: {path} (service logs in {log_dir})")
    return 0
