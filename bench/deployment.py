"""Start router + workers as separate processes on loopback (CPU or GPUs) and talk to them over gRPC.

Used by the integration tests and by the GPU disaggregation check (bench/disagg_gpu.py).
"""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.v1 import router_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Deployment:
    router: str
    decode: list[str]
    prefill: list[str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    spawn_args: dict[str, tuple[list[str], str | None]] = field(default_factory=dict)
    log_dir: Path | None = None
    common_args: list[str] = field(default_factory=list)

    def restart(self, name: str) -> None:
        """Start process ``name`` again with the same arguments (a new worker id)."""
        args, gpu = self.spawn_args[name]
        _spawn(name + "-restarted", args, self.log_dir, self, gpu)
        self.procs[name] = self.procs.pop(name + "-restarted")

    def router_stub(self) -> router_pb2_grpc.GenerationStub:
        return router_pb2_grpc.GenerationStub(grpc.insecure_channel(self.router))

    def stats(self, address: str) -> worker_pb2.WorkerStats:
        with grpc.insecure_channel(address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=10)

    def wait_whole(self, address: str, tries: int = 100) -> worker_pb2.WorkerStats:
        """Poll GetStats (bounded) until no block is referenced and nothing is in flight."""
        for _ in range(tries):
            s = self.stats(address)
            if (s.num_used_blocks == 0 and s.num_free_blocks == s.num_total_blocks and s.num_running == 0
                    and s.num_waiting == 0 and s.num_reserved == 0):
                return s
            time.sleep(0.1)
        raise AssertionError(f"{address} did not release its blocks: {s}")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


def _spawn(name: str, args: list[str], log_dir: Path, dep: Deployment, gpu: str | None = None) -> None:
    log = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               PDSERVE_LOG_LEVEL="INFO")
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    dep.procs[name] = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, env=env,
                                       stdout=log.open("w"), stderr=subprocess.STDOUT)
    dep.logs[name] = log


def decode_args(dep: Deployment, port: int, kv_port: int, role: str, common: list[str], extra: list[str]) -> list[str]:
    return ["decode", *common, "--port", str(port), "--kv-port", str(kv_port), "--role", role, *extra]


def start(log_dir: Path, model: str = "default", decode_blocks: int = 0, decode_role: str = "decode",
          num_prefill: int = 1, num_decode: int = 1, timeout: float = 240.0, device: str = "cpu",
          kv_memory_gb: float = 0.25, decode_gpus: list[str] | None = None, prefill_gpus: list[str] | None = None,
          extra_worker_args: list[str] = ()) -> Deployment:
    dep = Deployment(router=f"127.0.0.1:{free_port()}", decode=[], prefill=[])
    dep.log_dir = log_dir
    common = ["--host", "127.0.0.1", "--metrics-port", "0", "--model", model, "--device", device, *extra_worker_args]
    dep.common_args = common
    for i in range(num_decode):
        port = free_port()
        extra = ["--num-kv-blocks", str(decode_blocks)] if decode_blocks else ["--kv-memory-gb", str(kv_memory_gb)]
        args = decode_args(dep, port, free_port(), decode_role, common, extra)
        gpu = decode_gpus[i % len(decode_gpus)] if decode_gpus else None
        _spawn(f"decode{i}", args, log_dir, dep, gpu)
        dep.spawn_args[f"decode{i}"] = (args, gpu)
        dep.decode.append(f"127.0.0.1:{port}")
    for i in range(num_prefill):
        port = free_port()
        gpu = prefill_gpus[i % len(prefill_gpus)] if prefill_gpus else None
        _spawn(f"prefill{i}", ["prefill", *common, "--port", str(port), "--kv-memory-gb", str(kv_memory_gb)],
               log_dir, dep, gpu)
        dep.prefill.append(f"127.0.0.1:{port}")
    _spawn("router", ["router", "--host", "127.0.0.1", "--port", dep.router.split(":")[1], "--metrics-port", "0",
                      "--model", model, "--decode", ",".join(dep.decode), "--prefill", ",".join(dep.prefill)],
           log_dir, dep)
    try:
        asyncio.run(_wait_ready(dep, timeout, num_prefill, num_decode))
    except BaseException:
        dep.stop()
        raise
    return dep


async def _wait_ready(dep: Deployment, timeout: float, num_prefill: int, num_decode: int) -> None:
    """Wait for every service (and the router seeing its workers); fail fast if a process dies."""
    from pdserve.cmd_up import _wait_all
    task = asyncio.ensure_future(_wait_all(dep.decode + dep.prefill + [dep.router], timeout, num_prefill, num_decode))
    while not task.done():
        dead = [name for name, p in dep.procs.items() if p.poll() is not None]
        if dead:
            task.cancel()
            tail = dep.logs[dead[0]].read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"{dead[0]} exited during start-up:\n" + "\n".join(tail))
        await asyncio.sleep(0.2)
    task.result()


def start_up(log_dir: Path, up_args: list[str] = (), timeout: float = 240.0) -> Deployment:
    """``pdserve up`` (router + 1 prefill + 1 decode on the CPU by default) as one process."""
    from bench.serve.procs import free_port_range
    router_port, base = free_port(), free_port_range(4)
    dep = Deployment(router=f"127.0.0.1:{router_port}", decode=[f"127.0.0.1:{base}"], prefill=[f"127.0.0.1:{base + 2}"])
    dep.log_dir = log_dir
    _spawn("up", ["up", "--router-port", str(router_port), "--base-port", str(base), *up_args], log_dir, dep)
    try:
        asyncio.run(_wait_ready(dep, timeout, 1, 1))
    except BaseException:
        dep.stop()
        raise
    return dep
