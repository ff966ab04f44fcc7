"""``pdserve up``: router + prefill + decode workers on this machine, as separate processes.

With ``--demo`` it streams answers to a few sample chat prompts through the router and then
shuts everything down (``make run``). Otherwise it runs until Ctrl-C / SIGTERM.

Ports: the router takes ``--router-port`` (and ``--http-port``); worker i takes
``--base-port + 2i`` for gRPC (a decode worker ``+ 1`` for its KV store). With
``--metrics-port M`` the router serves /metrics on M and worker i on M + 1 + i. Every port is
checked before anything starts: a port in use is one error line naming the flag to change.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from pdserve.common import env
from pdserve.common.grpc_utils.errors import Unavailable

logger = logging.getLogger(__name__)
DEMO_PROMPTS = ["What is the capital of France?",
                "Name three primary colors.",
                "Write a haiku about the sea."]
# worker flags that `up` passes through to every worker when given (flag, type, help)
WORKER_FLAGS = (
    ("--dtype", str, "auto, float32, bfloat16, float16 (default: the workers' own, auto)"),
    ("--max-num-seqs", int, "most sequences a worker runs at once (default: the workers' own)"),
    ("--max-num-batched-tokens", int, "token budget of one engine step (default: the workers' own, by role)"),
    ("--max-model-len", int, "longest sequence in tokens (default: the model's)"),
    ("--kv-memory-gb", float, "memory for each worker's KV pool in GiB (default: the workers' own)"),
    ("--attention-backend", str, "attention kernels of the workers (default: auto)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=env.get("MODEL", "default"), help="checkpoint dir, preset, or 'default'")
    p.add_argument("--device", default=env.get("DEVICE", "cpu"), help="cpu or cuda")
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers (0 = co-located only)")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--role", choices=("decode", "both"), default="decode", help="role of the decode workers")
    p.add_argument("--prefill-gpus", default="",
                   help="comma list of GPU ids for prefill workers (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--decode-gpus", default="", help="comma list of GPU ids for decode workers")
    p.add_argument("--router-port", type=int, default=50051, help="the router's gRPC port (the public API)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="the router's OpenAI-compatible HTTP API (http://127.0.0.1:PORT/v1); 0 = off")
    p.add_argument("--base-port", type=int, default=50060,
                   help="first port for workers: worker i listens on BASE + 2i (a decode worker's KV store on +1)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics: the router on this port, worker i on PORT + 1 + i; 0 = off")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (router and workers)")
    p.add_argument("--num-kv-blocks", type=int, default=0,
                   help="KV pool size of each worker in blocks; 0 = from --kv-memory-gb or free memory")
    p.add_argument("--enforce-eager", action="store_true", help="workers run without CUDA graphs")
    for flag, kind, help_text in WORKER_FLAGS:
        p.add_argument(flag, type=kind, default=None, help=help_text)
    p.add_argument("--extra-worker-args", default="", help="more flags for every worker, as one string")
    p.add_argument("--extra-router-args", default="", help="more flags for the router, as one string")
    p.add_argument("--demo", action="store_true", help="stream answers to sample prompts, then stop")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds to wait for every service to be SERVING (model loading included)")


@dataclass(frozen=True)
class Child:
    """One service to start: its name in messages, command line, environment, gRPC address."""
    name: str
    cmd: list[str]
    environ: dict[str, str] | None
    address: str
    ports: dict[int, str]           # port -> the flag that sets it (for the port-in-use error)


def _metrics_port(args: argparse.Namespace, index: int) -> str:
    return str(args.metrics_port + index) if args.metrics_port else "0"


def _worker_cmd(kind: str, port: int, metrics_port: str, args: argparse.Namespace, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "pdserve.cli", kind, "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", metrics_port, "--model", args.model, "--device", args.device,
           "--block-size", str(args.block_size), *extra]
    if args.num_kv_blocks:
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    for flag, _, _ in WORKER_FLAGS:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + args.extra_worker_args.split()


def _gpu_env(gpus: str, index: int) -> dict[str, str] | None:
    ids = [g for g in gpus.split(",") if g]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ids[index % len(ids)]} if ids else None


def plan(args: argparse.Namespace) -> list[Child]:
    """The services to start, workers first, the router last."""
    children: list[Child] = []
    decode_addrs: list[str] = []
    prefill_addrs: list[str] = []
    port = args.base_port
    for kind, count in (("decode", args.decode), ("prefill", args.prefill)):
        for i in range(count):
            index = len(children)
            extra = ["--role", args.role, "--kv-port", str(port + 1)] if kind == "decode" else []
            ports = {port: "--base-port"} | ({port + 1: "--base-port"} if kind == "decode" else {})
            if args.metrics_port:
                ports[args.metrics_port + 1 + index] = "--metrics-port"
            gpus = args.decode_gpus if kind == "decode" else args.prefill_gpus
            children.append(Child(f"{kind} worker {i}", _worker_cmd(kind, port, _metrics_port(args, 1 + index),
                                                                    args, extra),
                                  _gpu_env(gpus, i), f"127.0.0.1:{port}", ports))
            (decode_addrs if kind == "decode" else prefill_addrs).append(f"127.0.0.1:{port}")
            port += 2
    router = [sys.executable, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(args.router_port),
              "--metrics-port", _metrics_port(args, 0), "--model", args.model, "--block-size", str(args.block_size),
              "--decode", ",".join(decode_addrs), "--prefill", ",".join(prefill_addrs),
              "--http-port", str(args.http_port), *args.extra_router_args.split()]
    ports = {args.router_port: "--router-port"} | ({args.http_port: "--http-port"} if args.http_port else {})
    if args.metrics_port:
        ports[args.metrics_port] = "--metrics-port"
    children.append(Child("router", router, None, f"127.0.0.1:{args.router_port}", ports))
    return children


def check_ports(children: list[Child]) -> None:
    """Unavailable naming the port, its service and the flag to change when a port is in use."""
    for child in children:
        for port, flag in child.ports.items():
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", port))
                except OSError as e:
                    raise Unavailable(f"cannot bind 127.0.0.1:{port} for the {child.name}: {e.strerror}; "
                                      f"pass another {flag}") from None


def start_processes(children: list[Child]) -> list[subprocess.Popen]:
    """Each in a session of its own: a Ctrl-C in the terminal reaches only ``up``, which then
    stops them in order (:func:`stop_processes`)."""
    return [subprocess.Popen(c.cmd, env=c.environ, start_new_session=True) for c in children]


def stop_processes(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    """SIGTERM the router (the last process) and wait for it, then the workers together: the
    router closes its worker streams before the workers drain, so nobody logs the other's exit."""
    end = time.monotonic() + timeout
    for group in (procs[-1:], procs[:-1]):
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in group:
            try:
                p.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


async def _wait_all(addresses: list[str], timeout: float, num_prefill: int, num_decode: int) -> None:
    """Every server SERVING, then the router seeing all its workers."""
    from pdserve.common.grpc_utils.server import client_channel, wait_ready
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
                raise Unavailable(f"router sees {info.num_prefill_workers} prefill / {info.num_decode_workers} "
                                  f"decode workers, expected {num_prefill} / {num_decode}")
            await asyncio.sleep(0.2)


async def _watch(children: list[Child], procs: list[subprocess.Popen]) -> None:
    """Return never; Unavailable as soon as a service exits."""
    while True:
        for child, proc in zip(children, procs):
            if proc.poll() is not None:
                raise Unavailable(f"the {child.name} exited with code {proc.returncode} during startup "
                                  "(its log is above)")
        await asyncio.sleep(0.2)


async def wait_started(children: list[Child], procs: list[subprocess.Popen], args: argparse.Namespace) -> None:
    """Everything SERVING, or Unavailable when a service exits or the startup timeout passes."""
    ready = asyncio.ensure_future(_wait_all([c.address for c in children], args.startup_timeout,
                                            args.prefill, args.decode))
    watch = asyncio.ensure_future(_watch(children, procs))
    try:
        done, _ = await asyncio.wait({ready, watch}, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()
    finally:
        for task in (ready, watch):
            task.cancel()
        await asyncio.gather(ready, watch, return_exceptions=True)


def _demo(router: str) -> None:
    from pdserve.client import stream_generate
    from pdserve.common.sampling_params import SamplingParams
    for prompt in DEMO_PROMPTS:
        sys.stdout.write(f"\n>>> {prompt}\n")
        for delta in stream_generate(router, prompt, SamplingParams(temperature=0.0, max_tokens=64)):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")


def run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))    # stop the services on SIGTERM too
    children = plan(args)
    check_ports(children)
    procs = start_processes(children)
    try:
        asyncio.run(wait_started(children, procs, args))
        logger.info("all services are SERVING; router at %s (gRPC)%s", children[-1].address,
                    f", http://127.0.0.1:{args.http_port}/v1 (OpenAI API)" if args.http_port else "")
        if args.demo:
            _demo(children[-1].address)
            return 0
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        logger.error("a service exited; stopping the others")
        return 1
    except KeyboardInterrupt:           # Ctrl-C: the normal way to stop
        return 0
    finally:
        stop_processes(procs)
