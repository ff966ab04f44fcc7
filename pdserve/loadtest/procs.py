"""pdserve's services as child processes: the one launcher of ``pdserve up``, the load tool, the
lab (bench/deployment.py) and the tests.

A :class:`Service` runs in a process group of its own, logs to a file, the terminal or nowhere,
is ready when its gRPC health says SERVING (:func:`wait_ready`, :func:`wait_workers`,
:func:`wait_started`), and stops on SIGTERM, its group killed after the grace (:func:`stop_all`:
the router first). Also: free ports, a process's CPU seconds, the load tool's command lines.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.common.security.config import ClientSecurity

ROOT = Path(__file__).resolve().parents[2]
STOP_GRACE_S = 30.0       # SIGTERM -> SIGKILL: as long as a service's own default drain grace
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (seconds), from /proc; 0.0 where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK   # fields 14 and 15 of stat(5)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with the source tree first on PYTHONPATH."""
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def pdserve_cmd(*args: str) -> list[str]:
    """The command line of ``pdserve ARGS`` under this interpreter."""
    return [sys.executable, "-m", "pdserve.cli", *args]


class ServiceExited(RuntimeError):
    """A service exited before it was ready."""


@dataclass
class Service:
    """One service as a child process (see the module doc). ``address``: the host:port whose gRPC
    health says when it is ready ("" = none); ``client``: the credentials that port expects
    (None: this process's default, plaintext unless set)."""
    name: str
    cmd: list[str]
    address: str
    log_path: Path | None = None      # its stdout and stderr, appended; None: see inherit_output
    extra_env: dict[str, str] = field(default_factory=dict)   # e.g. CUDA_VISIBLE_DEVICES
    from_source: bool = True          # run in ROOT with ROOT on PYTHONPATH; False: here, as this process
    inherit_output: bool = False      # without log_path: to this process's terminal (else dropped)
    client: ClientSecurity | None = None    # how to call ``address`` (mutual TLS, a token)
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Service:
        if self.log_path is None:
            self.proc = self._popen(None if self.inherit_output else subprocess.DEVNULL)
        else:
            with open(self.log_path, "ab") as out:   # the child keeps its own copy of the descriptor
                self.proc = self._popen(out)
        return self

    def _popen(self, out: IO[bytes] | int | None) -> subprocess.Popen:
        env = _env(self.extra_env) if self.from_source else dict(os.environ, **self.extra_env)
        return subprocess.Popen(self.cmd, cwd=ROOT if self.from_source else None, env=env, stdout=out,
                                stderr=None if out is None else subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def tree_pids(self) -> list[int]:
        """Live processes of this service: it and its descendants, from /proc (by parent, since a
        child may start its own session: `pdserve up` starts each of its services in one)."""
        children: dict[int, list[int]] = {}
        for d in Path("/proc").glob("[0-9]*"):
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(d.name))
        out, todo = [], [self.pid] if self.alive() else []
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def log_tail(self, n: int = 30) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def exited(self) -> ServiceExited:
        """The error of this service having exited during start-up, with where its log is."""
        code = self.proc.returncode if self.proc is not None else "?"
        where = (f"; the end of its log {self.log_path}:\n{self.log_tail(15)}" if self.log_path
                 else " (its log is above)" if self.inherit_output else "")
        return ServiceExited(f"{self.name} exited with code {code} during start-up{where}")

    def terminate(self) -> None:
        """SIGTERM: the service drains, then exits."""
        if self.proc is not None and self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def reap(self, deadline: float) -> None:
        """Wait for the exit until ``deadline`` (``time.monotonic()``), then SIGKILL whatever is
        left of the process group (the service itself, or what it started)."""
        if self.proc is None:
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(deadline - time.monotonic(), 0.1))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5.0)

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        stop_together([self], timeout)


def stop_together(services: Sequence[Service], timeout: float = STOP_GRACE_S) -> None:
    """SIGTERM every running one of ``services`` at once; SIGKILL what is left after ``timeout`` s.
    A service that exited already is left alone."""
    running = [svc for svc in services if svc.alive()]
    for svc in running:
        svc.terminate()
    end = time.monotonic() + timeout
    for svc in running:
        svc.reap(end)


def stop_all(services: Sequence[Service], timeout: float = STOP_GRACE_S) -> None:
    """The last of ``services`` first (the router, started after its workers: it closes its streams
    to them before they drain, so neither logs the other's exit), then the rest together; one
    ``timeout`` for all."""
    end = time.monotonic() + timeout
    stop_together(services[-1:], timeout)
    stop_together(services[:-1], max(end - time.monotonic(), 0.1))


# ---- ready ----------------------------------------------------------------------------------

def _run(coro: Awaitable[Any]) -> Any:
    from pdserve.loadtest.client import run_async
    return run_async(coro)


async def _first(main: Awaitable[Any], guard: Callable[[], None] | None) -> Any:
    """``main``'s result; ``guard()``, called every 0.2 s meanwhile, may raise to give up early."""
    task = asyncio.ensure_future(main)
    try:
        while not task.done():
            if guard is not None:
                guard()
            await asyncio.wait({task}, timeout=0.2)
        return task.result()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _check_running(services: Sequence[Service]) -> None:
    for svc in services:
        if not svc.alive():
            raise svc.exited()


async def _serving(svc: Service, timeout: float) -> None:
    from pdserve.common.grpc_utils.errors import Unavailable
    from pdserve.common.grpc_utils.server import wait_ready as health_serving
    try:
        await health_serving(svc.address, timeout, security=svc.client)
    except Unavailable as e:
        raise TimeoutError(f"{svc.name}: {e}\n{svc.log_tail()}".rstrip()) from None


async def _all_serving(services: Sequence[Service], timeout: float) -> None:
    await asyncio.gather(*(_serving(svc, timeout) for svc in services if svc.address))


EXIT_SETTLE_S = 0.5    # after SERVING: long enough for a child that failed to bind to have exited


def wait_ready(services: Sequence[Service], timeout: float = 120.0) -> None:
    """Until every service with an address is SERVING (gRPC health), all at once.
    :class:`ServiceExited` (with the end of its log) as soon as one exits, also when it exits
    while another process answers on its address (a port taken between its pick and its bind);
    TimeoutError (naming it) after ``timeout`` s."""
    _run(_first(_all_serving(services, timeout), lambda: _check_running(services)))
    time.sleep(EXIT_SETTLE_S)
    _check_running(services)


async def _workers_seen(router: str, num_prefill: int, num_decode: int, timeout: float,
                        security: ClientSecurity | None) -> dict:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from pdserve.common.grpc_utils.server import client_channel
    from pdserve.v1 import router_pb2, router_pb2_grpc
    end = time.monotonic() + timeout
    last = None
    async with client_channel(router, security=security) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < end:
            try:
                last = await stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=2.0)
                if last.num_prefill_workers >= num_prefill and last.num_decode_workers >= num_decode:
                    return MessageToDict(last, preserving_proto_field_name=True)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    seen = f"{last.num_prefill_workers} prefill / {last.num_decode_workers} decode" if last else "no answer"
    raise TimeoutError(f"router {router} did not report {num_prefill} prefill / {num_decode} decode workers "
                       f"in {timeout:.0f} s (it reports {seen})")


def wait_workers(router: str, num_prefill: int, num_decode: int, timeout: float = 60.0,
                 check: Callable[[], None] | None = None, security: ClientSecurity | None = None) -> dict:
    """Until the router reports at least the given healthy workers; its ModelInfo as a dict.
    ``check()`` (optional) is called between polls and may raise to give up early; ``security``:
    the router port's credentials (None: this process's default)."""
    result: dict = _run(_first(_workers_seen(router, num_prefill, num_decode, timeout, security), check))
    return result


def wait_started(services: Sequence[Service], router: str, num_prefill: int, num_decode: int,
                 timeout: float, security: ClientSecurity | None = None) -> dict:
    """:func:`wait_ready` (each service asked with its own ``client`` credentials), then
    :func:`wait_workers` of the router at ``router`` with ``security`` (each phase within
    ``timeout``), failing fast with :class:`ServiceExited` when any of ``services`` exits."""
    wait_ready(services, timeout)
    return wait_workers(router, num_prefill, num_decode, timeout, check=lambda: _check_running(services),
                        security=security)


# ---- command lines ----------------------------------------------------------------------------

def worker_cmd(kind: str, port: int, *, metrics_port: int = 0, kv_port: int | None = None,
               role: str | None = None, extra: Sequence[str] = ()) -> list[str]:
    """``pdserve prefill|decode`` on 127.0.0.1:``port`` (a decode worker's KV store on ``kv_port``)."""
    cmd = pdserve_cmd(kind, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port))
    if kv_port is not None:
        cmd += ["--kv-port", str(kv_port)]
    if role is not None:
        cmd += ["--role", role]
    return cmd + list(extra)


def router_cmd(port: int, *, model: str, decode: Sequence[str], prefill: Sequence[str] = (),
               metrics_port: int = 0, extra: Sequence[str] = ()) -> list[str]:
    """``pdserve router`` on 127.0.0.1:``port`` in front of the given workers."""
    return pdserve_cmd("router", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port),
                       "--model", model, "--decode", ",".join(decode), "--prefill", ",".join(prefill), *extra)


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
    cmd = router_cmd(port, model=model, decode=decode, prefill=prefill, extra=extra or ())
    return Service(f"router-{port}", cmd, f"127.0.0.1:{port}", (log_dir / f"router-{port}.log") if log_dir else None)


def pdserve_up(router_port: int, base_port: int, args: list[str], log_dir: Path | None = None,
               name: str = "up") -> Service:
    cmd = pdserve_cmd("up", "--router-port", str(router_port), "--base-port", str(base_port),
                      *([] if "--http-port" in args else ["--http-port", "0"]), *args)
    return Service(f"pdserve-up-{name}", cmd, f"127.0.0.1:{router_port}",
                   (log_dir / f"pdserve-up-{name}.log") if log_dir else None)
