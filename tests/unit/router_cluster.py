"""Helpers of tests/unit/test_router_integration.py: the router and scripted workers as real
processes on free local ports (``Proc``, ``worker``, ``router``), health-polled until SERVING,
grouped as a ``Deployment``; bounded polling and the scripted outputs a request must get.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.loadtest.ports import free_port
from pdserve.loadtest.scripted_state import script_token
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SP = common_pb2.SamplingParams
FR = common_pb2
VOCAB = 49152
TINY_VOCAB = 512


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    port: int = 0
    popen: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT), PDSERVE_LOG_LEVEL="INFO")
        self.popen = subprocess.Popen([sys.executable, *self.args], cwd=ROOT, env=env,
                                      stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def tail(self, n: int = 30) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.name} ---\n" + "\n".join(lines[-n:])

    def send(self, sig: int = signal.SIGTERM) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)

    def stop(self, sig: int | None = signal.SIGTERM) -> None:
        """Send ``sig`` (None: it was sent already) and wait for the exit (kill after 10 s)."""
        if self.popen is not None and self.popen.poll() is None:
            if sig is not None:
                self.popen.send_signal(sig)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def wait_serving(procs: list[Proc], timeout: float = 120.0) -> None:
    """Poll grpc.health of each process until SERVING; fail fast when one exits."""
    end = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for p in list(pending):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode}\n{p.tail()}")
            try:
                with grpc.insecure_channel(p.address) as ch:
                    reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    pending.remove(p)
            except grpc.RpcError:
                pass
        if time.monotonic() > end:
            raise RuntimeError("not SERVING in time:\n" + "\n".join(p.tail() for p in pending))
        if pending:
            time.sleep(0.1)


@dataclass
class Deployment:
    router: Proc
    workers: dict[str, Proc] = field(default_factory=dict)
    metrics_port: int = 0

    def stub(self) -> router_pb2_grpc.GenerationStub:
        return router_pb2_grpc.GenerationStub(grpc.insecure_channel(self.router.address))

    def stats(self, name: str) -> worker_pb2.WorkerStats:
        with grpc.insecure_channel(self.workers[name].address) as ch:
            return worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), timeout=2)


def worker(tmp: Path, name: str, role: str, *extra: str) -> Proc:
    port = free_port()
    return Proc(name, ["-m", "pdserve.loadtest.scripted_worker", "--port", str(port), "--role", role, *extra],
                tmp / f"{name}.log", port)


def router(tmp: Path, name: str, model: str, prefill: str, decode: str, metrics_port: int = 0) -> Proc:
    port = free_port()
    return Proc(name, ["-m", "pdserve.router.main", "--port", str(port), "--host", "127.0.0.1", "--metrics-port",
                       str(metrics_port), "--model", model, "--prefill", prefill, "--decode", decode,
                       "--router-id", name], tmp / f"{name}.log", port)


def poll(check: Callable[[], bool], what: str, attempts: int = 50, interval: float = 0.1) -> None:
    """Bounded polling of a condition (no blind sleeps)."""
    for _ in range(attempts):
        if check():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for: {what}")


def idle(dep: Deployment, name: str) -> Callable[[], bool]:
    def check() -> bool:
        s = dep.stats(name)
        return s.num_running == 0 and s.num_reserved == 0 and s.num_used_blocks == 0
    return check


def ids_request(ids: list[int], **params) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), params=SP(**params))


def expected(prompt: list[int], n: int, vocab: int = VOCAB) -> list[int]:
    return [script_token(prompt, i, vocab) for i in range(n)]
