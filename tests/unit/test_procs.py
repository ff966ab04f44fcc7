"""The launcher (pdserve.loadtest.procs) with real child processes: waiting for a service fails
fast, naming it and its log, when it exits; stopping one that ignores SIGTERM kills it after the
grace; a service that exited already is left alone."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import pytest

from pdserve.loadtest import ports, procs


def _python(name: str, code: str, log_dir=None) -> procs.Service:
    return procs.Service(name, [sys.executable, "-c", code], f"127.0.0.1:{ports.free_port()}",
                         log_dir / f"{name}.log" if log_dir else None)


def test_wait_ready_fails_fast_when_a_service_exits(tmp_path):
    slow = _python("slow", "import time; time.sleep(60)").start()
    dead = _python("dead", "print('bad flag'); raise SystemExit(3)", tmp_path).start()
    start = time.monotonic()
    try:
        with pytest.raises(procs.ServiceExited, match="dead exited with code 3 during start-up") as e:
            procs.wait_ready([slow, dead], timeout=60)
        assert "bad flag" in str(e.value) and time.monotonic() - start < 30
    finally:
        procs.stop_all([slow, dead])
    assert not slow.alive()


def test_stop_kills_what_ignores_sigterm_after_the_grace():
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    svc = procs.Service("stubborn", [sys.executable, "-c", code], "", inherit_output=False).start()
    time.sleep(1.0)
    start = time.monotonic()
    svc.stop(timeout=1.0)
    assert svc.proc is not None and svc.proc.returncode == -9 and time.monotonic() - start < 10
    svc.stop(timeout=1.0)         # exited already: nothing to do


def test_wait_ready_notices_a_service_whose_port_another_process_answers(tmp_path):
    """A port taken between its pick and the child's bind: health SERVING comes from the other
    process, the child exits on its bind error; waiting must still fail, naming the child."""
    import asyncio
    import threading

    from pdserve.common.grpc_utils.server import build_server

    ready, done = threading.Event(), threading.Event()
    holder: dict = {}

    def serve() -> None:               # the process already on the port: a SERVING gRPC server
        async def main() -> None:
            server = build_server("127.0.0.1:0", [])
            await server.start()
            await server.set_serving(True)
            holder["port"] = server.port
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.05)
            await server.stop_now()
        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    code = "import time; time.sleep(0.1); print('cannot bind: address in use'); raise SystemExit(1)"
    child = procs.Service("late", [sys.executable, "-S", "-c", code], f"127.0.0.1:{holder['port']}",
                          tmp_path / "late.log").start()
    try:
        with pytest.raises(procs.ServiceExited, match="late exited"):
            procs.wait_ready([child], timeout=30)
    finally:
        done.set()
        thread.join(10)
        procs.stop_all([child])



def test_tree_pids_follows_children_into_their_own_sessions():
    """`pdserve up` starts each service in a session of its own; `bench compare --launch` counts
    them as the deployment's processes all the same."""
    code = ("import subprocess, sys, time\n"
            "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=s)"
            " for s in (True, False)]\n"
            "print('up', flush=True); time.sleep(60)")
    svc = procs.Service("parent", [sys.executable, "-c", code], "", inherit_output=False).start()
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 30
        while len(svc.tree_pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = svc.tree_pids()
        assert len(pids) == 3 and pids[0] == svc.pid
    finally:
        svc.stop(timeout=1.0)
        for pid in pids[1:]:          # the parent's children outlive it (it does not stop them)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert svc.tree_pids() == []
