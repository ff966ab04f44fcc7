"""Service processes for the benchmarks: scripted workers, a router, ``pdserve up``.

Every process is started in its own session (process group) so that it, and whatever it
starts, can be stopped by its own id; :class:`Service` stops with SIGINT first (``pdserve up``
turns it into a clean shutdown of its children), then SIGTERM, then SIGKILL of its group.
CPU use of a process is read from ``/proc/<pid>/stat`` (Linux).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[2]
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int, consecutive: int = 1) -> list[int]:
    """``n`` free ports; with ``consecutive`` = 2 each port p also has p + 1 free (worker + KV store)."""
    out: list[int] = []
    while len(out) < n:
        p = free_port()
        if consecutive > 1:
            try:
                for k in range(1, consecutive):
                    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                        s.bind(("127.0.0.1", p + k))
            except OSError:
                continue
        if all(abs(p - q) >= consecutive for q in out):
            out.append(p)
    return out


def free_port_range(n: int, tries: int = 200) -> int:
    """The first of ``n`` consecutive free ports."""
    import random
    for _ in range(tries):
        base = random.randint(20000, 60000 - n)
        try:
            for k in range(n):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports found")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds), from /proc; 0.0 where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK   # fields 14 and 15 of stat(5)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


@dataclass
class Service:
    name: str
    cmd: list[str]
    address: str                      # host:port to health-check ("" = none)
    log_path: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)   # e.g. CUDA_VISIBLE_DEVICES
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Service:
        if self.log_path is None:
            self.proc = self._popen(subprocess.DEVNULL)
        else:
            with open(self.log_path, "ab") as out:   # the child keeps its own copy of the descriptor
                self.proc = self._popen(out)
        return self

    def _popen(self, out: IO[bytes] | int) -> subprocess.Popen:
        return subprocess.Popen(self.cmd, cwd=ROOT, env=_env(self.extra_env), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def group_pids(self) -> list[int]:
        """Live processes of this service's process group (it and what it started), from /proc."""
        out = []
        for d in Path("/proc").glob("[0-9]*"):
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.pid and fields[0] != "Z":
                out.append(int(d.name))
        return out

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # whatever is left of the group we created (pdserve up's workers, say)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)


def wait_ready(services: list[Service], timeout: float = 120.0) -> None:
    """Wait until each service's gRPC health says SERVING; RuntimeError (with its log) if one dies."""
    from pdserve.common.grpc_utils.server import wait_ready as _wait
    from pdserve.loadtest.client import run_async

    end = time.monotonic() + timeout
    for svc in services:
        if not svc.address:
            continue
        while True:
            if not svc.alive():
                raise RuntimeError(f"{svc.name} exited ({svc.proc.returncode if svc.proc else '?'}):\n{svc.log_tail()}")
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{svc.name} at {svc.address} not SERVING in {timeout:.0f} s:\n{svc.log_tail()}")
            try:
                run_async(_wait(svc.address, min(2.0, remaining)))
                break
            except Exception:  # noqa: BLE001 - not yet
                continue


def wait_workers(router: str, num_prefill: int, num_decode: int, timeout: float = 60.0, check=None) -> dict:
    """Wait until the router reports at least the given healthy workers; its ModelInfo as a dict.
    ``check()`` (optional) is called between polls and may raise to give up early."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve.v1 import router_pb2, router_pb2_grpc
    end = time.monotonic() + timeout
    last = None
    with grpc.insecure_channel(router) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        while time.monotonic() < end:
            try:
                last = stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=2.0)
                if last.num_prefill_workers >= num_prefill and last.num_decode_workers >= num_decode:
                    return MessageToDict(last, preserving_proto_field_name=True)
            except grpc.RpcError:
                pass
            if check is not None:
                check()
            time.sleep(0.1)
    raise TimeoutError(f"router {router} did not report {num_prefill} prefill / {num_decode} decode workers "
                       f"in {timeout:.0f} s (last: {last})")


def scripted_worker(port: int, role: str = "both", *, step_ms: float = 5.0, prefill_ms: float | None = None,
                    num_blocks: int = 16384, vocab: int = 49152, max_model_len: int = 8192,
                    model: str = "SmolLM2-135M-Instruct", extra: list[str] | None = None,
                    log_dir: Path | None = None) -> Service:
    cmd = [sys.executable, "-m", "pdserve.loadtest.scripted_worker", "--host", "127.0.0.1", "--port", str(port),
           "--role", role, "--step-ms", str(step_ms), "--num-blocks", str(num_blocks), "--vocab", str(vocab),
           "--max-model-len", str(max_model_len), "--model", model]
    if prefill_ms is not None:
        cmd += ["--prefill-ms", str(prefill_ms)]
    cmd += extra or []
    return Service(f"scripted-{role}-{port}", cmd, f"127.0.0.1:{port}",
                   (log_dir / f"scripted-{role}-{port}.log") if log_dir else None)


def router(port: int, *, decode: Sequence[str], prefill: Sequence[str] = (), model: str = "default",
           extra: list[str] | None = None, log_dir: Path | None = None) -> Service:
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--model", model, "--decode", ",".join(decode), "--prefill", ",".join(prefill),
           *(extra or [])]
    return Service(f"router-{port}", cmd, f"127.0.0.1:{port}", (log_dir / f"router-{port}.log") if log_dir else None)


def pdserve_up(router_port: int, base_port: int, args: list[str], log_dir: Path | None = None,
               name: str = "up") -> Service:
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--router-port", str(router_port),
           "--base-port", str(base_port), *([] if "--http-port" in args else ["--http-port", "0"]), *args]
    return Service(f"pdserve-up-{name}", cmd, f"127.0.0.1:{router_port}",
                   (log_dir / f"pdserve-up-{name}.log") if log_dir else None)


def stop_all(services: list[Service]) -> None:
    for svc in reversed(services):
        svc.stop()
