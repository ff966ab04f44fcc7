"""``pdserve up``: router + prefill + decode workers on this machine, as separate processes.

With ``--demo`` it streams answers to a few sample chat prompts through the router and then
shuts everything down (``make run``). Otherwise it runs until Ctrl-C / SIGTERM.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

from common import env

logger = logging.getLogger(__name__)
DEMO_PROMPTS = ["What is the capital of France?",
                "Name three primary colors.",
                "Write a haiku about the sea."]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env.get("MODEL", "default"), help="checkpoint dir, preset, or 'default'")
    p.add_argument("--device", default=env.get("DEVICE", "cpu"), help="cpu or cuda")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers (0 = co-located only)")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--role", choices=("decode", "both"), default="decode", help="role of the decode workers")
    p.add_argument("--prefill-gpus", default="", help="comma list of GPU ids for prefill workers (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--decode-gpus", default="", help="comma list of GPU ids for decode workers")
    p.add_argument("--router-port", type=int, default=50051)
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP API (http://127.0.0.1:PORT/v1); 0 = off")
    p.add_argument("--base-port", type=int, default=50060, help="first port for workers (gRPC, KV store)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=0)
    p.add_argument("--extra-worker-args", default="", help="more flags for every worker, as one string")
    p.add_argument("--extra-router-args", default="", help="more flags for the router, as one string")
    p.add_argument("--demo", action="store_true", help="stream answers to sample prompts, then stop")
    p.add_argument("--startup-timeout", type=float, default=600.0)


def _worker_cmd(kind: str, port: int, args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", kind, "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--model", args.model, "--device", args.device,
           "--block-size", str(args.block_size), *extra, *args.extra_worker_args.split()]
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return cmd


def _gpu_env(gpus: str, index: int) -> dict[str, str]:
    environ = dict(os.environ)
    ids = [g for g in gpus.split(",") if g]
    if ids:
        environ["CUDA_VISIBLE_DEVICES"] = ids[index % len(ids)]
    return environ


def start_processes(args: argparse.Namespace) -> tuple[list[subprocess.Popen], list[str]]:
    procs, addresses, port = [], [], args.base_port
    decode_addrs, prefill_addrs = [], []
    for i in range(args.decode):
        extra = ["--role", args.role, "--kv-port", str(port + 1)]
        procs.append(subprocess.Popen(_worker_cmd("decode", port, args, extra), env=_gpu_env(args.decode_gpus, i)))
        decode_addrs.append(f"127.0.0.1:{port}")
        port += 2
    for i in range(args.prefill):
        procs.append(subprocess.Popen(_worker_cmd("prefill", port, args, []), env=_gpu_env(args.prefill_gpus, i)))
        prefill_addrs.append(f"127.0.0.1:{port}")
        port += 2
    addresses = decode_addrs + prefill_addrs
    router = [sys.executable, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(args.router_port),
              "--metrics-port", "0", "--model", args.model, "--block-size", str(args.block_size),
              "--decode", ",".join(decode_addrs), "--prefill", ",".join(prefill_addrs),
              "--http-port", str(args.http_port), *args.extra_router_args.split()]
    procs.append(subprocess.Popen(router))
    return procs, addresses + [f"127.0.0.1:{args.router_port}"]


def stop_processes(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(end - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()


async def _wait_all(addresses: list[str], timeout: float, num_prefill: int, num_decode: int) -> None:
    """Every server SERVING, then the router seeing all its workers."""
    from common.grpc_utils.server import client_channel, wait_ready
    from pdserve.v1 import router_pb2, router_pb2_grpc
    await asyncio.gather(*(wait_ready(a, timeout) for a in addresses))
    deadline = time.monotonic() + timeout
    async with client_channel(addresses[-1]) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        while True:
            info = await stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=5)
            if info.num_decode_workers >= num_decode and info.num_prefill_workers >= num_prefill:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router sees {info.num_prefill_workers} prefill / {info.num_decode_workers} "
                                   f"decode workers, expected {num_prefill} / {num_decode}")
            await asyncio.sleep(0.2)


def _demo(router: str) -> None:
    from common.engine.sampling_params import SamplingParams
    from pdserve.client import stream_generate
    for prompt in DEMO_PROMPTS:
        sys.stdout.write(f"\n>>> {prompt}\n")
        for delta in stream_generate(router, prompt, SamplingParams(temperature=0.0, max_tokens=64)):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # stop the services on SIGTERM too
    procs, addresses = start_processes(args)
    try:
        asyncio.run(_wait_all(addresses, args.startup_timeout, args.prefill, args.decode))
        logger.info("all services are SERVING; router at %s (gRPC)%s", addresses[-1],
                    f", http://127.0.0.1:{args.http_port}/v1 (OpenAI API)" if args.http_port else "")
        if args.demo:
            _demo(addresses[-1])
            return 0
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        logger.error("a service exited; stopping the others")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stop_processes(procs)
