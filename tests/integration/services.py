"""Start the three services as separate processes on loopback and talk to them over gRPC."""
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

ROOT = Path(__file__).resolve().parents[2]


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


def _spawn(name: str, args: list[str], log_dir: Path, dep: Deployment) -> None:
    log = log_dir / f"{name}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="INFO")
    dep.procs[name] = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], cwd=ROOT, env=env,
                                       stdout=log.open("w"), stderr=subprocess.STDOUT)
    dep.logs[name] = log


def start(log_dir: Path, model: str = "default", decode_blocks: int = 0, decode_role: str = "decode",
          num_prefill: int = 1, num_decode: int = 1, timeout: float = 240.0) -> Deployment:
    dep = Deployment(router=f"127.0.0.1:{free_port()}", decode=[], prefill=[])
    common = ["--host", "127.0.0.1", "--metrics-port", "0", "--model", model, "--device", "cpu"]
    for i in range(num_decode):
        port = free_port()
        extra = ["--num-kv-blocks", str(decode_blocks)] if decode_blocks else ["--kv-memory-gb", "0.25"]
        _spawn(f"decode{i}", ["decode", *common, "--port", str(port), "--kv-port", str(free_port()),
                              "--role", decode_role, *extra], log_dir, dep)
        dep.decode.append(f"127.0.0.1:{port}")
    for i in range(num_prefill):
        port = free_port()
        _spawn(f"prefill{i}", ["prefill", *common, "--port", str(port), "--kv-memory-gb", "0.25"], log_dir, dep)
        dep.prefill.append(f"127.0.0.1:{port}")
    _spawn("router", ["router", "--host", "127.0.0.1", "--port", dep.router.split(":")[1], "--metrics-port", "0",
                      "--model", model, "--decode", ",".join(dep.decode), "--prefill", ",".join(dep.prefill)],
           log_dir, dep)
    try:
        from pdserve.cmd_up import _wait_all
        asyncio.run(_wait_all(dep.decode + dep.prefill + [dep.router], timeout, num_prefill, num_decode))
    except BaseException:
        dep.stop()
        raise
    return dep
