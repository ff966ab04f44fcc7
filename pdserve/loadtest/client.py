"""The load generator: ``Generation.Generate`` streams to the router from asyncio (grpc.aio),
each streamed message time-stamped, in one or several client processes.

With ``num_procs > 1`` request ``i`` goes to process ``i % N`` with its offset, so the merged
arrivals are the ones asked for; all start at one common ``perf_counter`` time once connected.
Each process reports its records and CPU use, and ``send_lag`` shows whether it kept up.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing as mp
import os
import queue as queue_mod
import resource
import time
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

import numpy as np

from pdserve.loadtest.arrivals import split_concurrency
from pdserve.loadtest.datasets import BenchRequest
from pdserve.loadtest.metrics import RequestRecord

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.use_local_subchannel_pool", 1),   # one TCP connection per channel, not one shared
)
READY_TIMEOUT_S = 60.0


_LOOP: asyncio.AbstractEventLoop | None = None


def run_async(coro):
    """Run ``coro`` on this process's one event loop, kept open between calls (grpc.aio binds its
    poller to the first loop it runs on)."""
    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    asyncio.set_event_loop(_LOOP)
    return _LOOP.run_until_complete(coro)


@dataclass
class LoadResult:
    records: list[RequestRecord]
    start: float          # the common start time (perf_counter)
    duration: float       # start -> the last call's end (s)
    client: dict[str, Any]


def _fill_from_message(rec: RequestRecord, msg, t: float) -> None:
    rec.msg_times.append(t)
    rec.msg_tokens.append(len(msg.token_ids))
    if msg.finish_reason:
        from pdserve.v1 import common_pb2
        rec.finish_reason = common_pb2.FinishReason.Name(msg.finish_reason)
        if msg.HasField("usage"):
            rec.prompt_tokens = msg.usage.prompt_tokens or rec.prompt_tokens
            rec.output_tokens = msg.usage.completion_tokens
            rec.cached_tokens = msg.usage.cached_tokens


async def send_one(stub, proto, rec: RequestRecord, prompt_len: int, timeout: float | None,
                   sem: asyncio.Semaphore | None = None) -> RequestRecord:
    """One Generate stream, recorded into ``rec``."""
    import grpc
    async with (sem if sem is not None else contextlib.nullcontext()):
        rec.prompt_tokens = prompt_len
        rec.send_time = time.perf_counter()
        call = stub.Generate(proto, timeout=timeout)
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                _fill_from_message(rec, msg, time.perf_counter())
            rec.code = "OK"
        except grpc.aio.AioRpcError as e:
            rec.code = e.code().name
            rec.error = e.details() or ""
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - a client bug must not end the run
            rec.code = "CLIENT_ERROR"
            rec.error = repr(e)
        rec.end_time = time.perf_counter()
        if not rec.output_tokens:
            rec.output_tokens = sum(rec.msg_tokens)
    return rec


async def _send_after(pred: asyncio.Task, stub, proto, rec: RequestRecord, prompt_len: int,
                      timeout: float | None, sem: asyncio.Semaphore | None) -> RequestRecord:
    """``send_one`` once ``pred`` (the request this one follows) has ended; a later release than
    scheduled is the workload's, so it moves the schedule rather than counting as send lag."""
    await asyncio.wait([pred])
    now = time.perf_counter()
    if now > rec.scheduled_time:
        rec.scheduled_time = rec.release_time = now
    return await send_one(stub, proto, rec, prompt_len, timeout, sem)


def _cpu_now() -> tuple[float, float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), ru.ru_utime, ru.ru_stime


def _open_channels(address: str, num_channels: int) -> list[Any]:
    """``num_channels`` gRPC channels (at least one per address of ``address``, a comma-separated
    list of router replicas, which the channels alternate between)."""
    import grpc
    addrs = [a for a in address.split(",") if a]
    return [grpc.aio.insecure_channel(addrs[i % len(addrs)],
                                      options=list(CHANNEL_OPTIONS) + [("pdserve.bench.channel", i)])
            for i in range(max(len(addrs), num_channels))]


async def _send_all(items: Sequence[tuple[int, BenchRequest, float]], stubs: Sequence[Any], protos: Sequence[Any],
                    start_at: float, timeout: float | None, sem: asyncio.Semaphore | None,
                    progress: Callable[[int], None]) -> list[RequestRecord]:
    """Release each request at ``start_at`` plus its offset, over the stubs in turn; their records
    once all have ended."""
    tasks: list[asyncio.Task] = []
    sent: dict[int, asyncio.Task] = {}
    for k, (idx, req, off) in enumerate(items):
        target = start_at + off
        delay = target - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = RequestRecord(index=idx, scheduled_time=target, release_time=time.perf_counter())
        stub = stubs[k % len(stubs)]
        if req.after >= 0:      # _shares put the request it follows in this process, earlier
            coro = _send_after(sent[req.after], stub, protos[k], rec, req.prompt_len, timeout, sem)
        else:
            coro = send_one(stub, protos[k], rec, req.prompt_len, timeout, sem)
        task = sent[idx] = asyncio.create_task(coro)
        task.add_done_callback(lambda _t: progress(1))
        tasks.append(task)
    return list(await asyncio.gather(*tasks))


def _proc_info(num_requests: int, limit: int | None, cpu0: tuple[float, float, float],
               cpu1: tuple[float, float, float], wall: float) -> dict[str, Any]:
    """What one process reports besides its records: its share and its CPU use while sending."""
    user, sys_ = cpu1[1] - cpu0[1], cpu1[2] - cpu0[2]
    return {"pid": os.getpid(), "requests": num_requests, "concurrency_limit": limit,
            "process_time_s": cpu1[0] - cpu0[0], "cpu_user_s": user, "cpu_sys_s": sys_,
            "wall_s": wall, "cpu_util": (user + sys_) / wall if wall > 0 else 0.0,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0}


async def _run_proc(address: str, items: Sequence[tuple[int, BenchRequest, float]], limit: int | None,
                    timeout: float | None, num_channels: int, ready: Callable[[], float],
                    progress: Callable[[int], None]) -> tuple[list[RequestRecord], dict[str, Any]]:
    """One process's share: connect, wait for the common start (``ready()`` returns it), send."""
    from pdserve.v1 import router_pb2_grpc
    channels = _open_channels(address, num_channels)
    try:
        await asyncio.wait_for(asyncio.gather(*(c.channel_ready() for c in channels)), READY_TIMEOUT_S)
        stubs = [router_pb2_grpc.GenerationStub(c) for c in channels]
        tag = uuid.uuid4().hex[:8]
        protos = [req.to_proto(f"bench-{tag}-{idx}") for idx, req, _ in items]
        sem = asyncio.Semaphore(limit) if limit else None
        gc.collect()
        gc.freeze()
        start_at = await asyncio.to_thread(ready)
        delay = start_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        cpu0 = _cpu_now()
        records = await _send_all(items, stubs, protos, start_at, timeout, sem, progress)
        cpu1 = _cpu_now()
        wall = time.perf_counter() - start_at
    finally:
        gc.unfreeze()
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
    return records, _proc_info(len(items), limit, cpu0, cpu1, wall)


def _child_main(proc_no: int, address: str, items, limit, timeout, num_channels, q, go, start_val) -> None:
    pending = [0]
    last = [time.perf_counter()]

    def ready() -> float:
        q.put(("ready", proc_no, None))
        go.wait()
        return start_val.value

    def progress(n: int) -> None:
        pending[0] += n
        now = time.perf_counter()
        if now - last[0] > 0.2:
            q.put(("progress", proc_no, pending[0]))
            pending[0], last[0] = 0, now

    try:
        records, info = run_async(_run_proc(address, items, limit, timeout, num_channels, ready, progress))
        if pending[0]:
            q.put(("progress", proc_no, pending[0]))
        q.put(("result", proc_no, (records, info)))
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        q.put(("error", proc_no, f"{type(e).__name__}: {e}"))
        raise


def _client_summary(records: list[RequestRecord], procs: list[dict], num_channels: int) -> dict[str, Any]:
    lag = np.array([r.release_time - r.scheduled_time for r in records]) * 1000
    wait = np.array([r.send_time - r.release_time for r in records if r.send_time]) * 1000
    util = [p["cpu_util"] for p in procs]
    return {"num_procs": len(procs), "channels_per_proc": num_channels, "procs": procs,
            "total_cpu_s": sum(p["cpu_user_s"] + p["cpu_sys_s"] for p in procs),
            "max_cpu_util": max(util, default=0.0),
            # send lag: how late the client released requests against the arrival schedule
            # (a busy client shows here first); queue: time waiting for the concurrency limit
            "mean_send_lag_ms": float(lag.mean()) if lag.size else 0.0,
            "p99_send_lag_ms": float(np.percentile(lag, 99)) if lag.size else 0.0,
            "max_send_lag_ms": float(lag.max()) if lag.size else 0.0,
            "mean_client_queue_ms": float(wait.mean()) if wait.size else 0.0,
            "p99_client_queue_ms": float(np.percentile(wait, 99)) if wait.size else 0.0}


Item = tuple[int, BenchRequest, float]     # (index in the workload, request, arrival offset s)


def _shares(items: list[Item], num_procs: int) -> list[list[Item]]:
    """The requests of each client process: in turn, except that a request that follows another
    (``after``, e.g. a conversation's next turn) goes where that one went."""
    owner: dict[int, int] = {}
    shares: list[list[Item]] = [[] for _ in range(num_procs)]
    for k, item in enumerate(items):
        idx, req, _ = item
        if req.after >= idx:
            raise ValueError(f"request {idx} follows request {req.after}, which does not come before it")
        p = owner[req.after] if req.after >= 0 else k % num_procs
        owner[idx] = p
        shares[p].append(item)
    return shares


def _run_here(address: str, items: list[Item], limit: int | None, timeout: float | None, num_channels: int,
              progress: Callable[[int], None]) -> tuple[list[RequestRecord], list[dict[str, Any]], float]:
    """All requests from this process: its records, its info (one), the start time."""
    start = [0.0]

    def ready() -> float:
        start[0] = time.perf_counter() + 0.01
        return start[0]

    records, info = run_async(_run_proc(address, items, limit, timeout, num_channels, ready, progress))
    return records, [info], start[0]


def _check_children(children: Sequence[BaseProcess], connecting: bool, deadline: float) -> None:
    """Raise if a client process has failed, or if they are still connecting after ``deadline``."""
    dead = [c for c in children if c.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"client process {dead[0].name} exited with {dead[0].exitcode}") from None
    if connecting and time.monotonic() > deadline:
        raise TimeoutError("client processes did not connect to the router in time") from None


def _collect(q: Any, children: Sequence[BaseProcess], go: Any, start_val: Any,
             progress: Callable[[int], None]) -> dict[int, tuple]:
    """The client processes' messages until each has sent its result: once all are connected, the
    common start; their progress to ``progress``; a failure raised. Each process's result."""
    num_procs = len(children)
    results: dict[int, tuple] = {}
    ready_n = 0
    deadline = time.monotonic() + READY_TIMEOUT_S + 30
    while len(results) < num_procs:
        try:
            kind, p, payload = q.get(timeout=0.5)
        except queue_mod.Empty:
            _check_children(children, ready_n < num_procs, deadline)
            continue
        if kind == "ready":
            ready_n += 1
            if ready_n == num_procs:
                start_val.value = time.perf_counter() + 0.05
                go.set()
        elif kind == "progress":
            progress(payload)
        elif kind == "result":
            results[p] = payload
        elif kind == "error":
            raise RuntimeError(f"client process {p} failed: {payload}")
    return results


def _run_children(address: str, shares: list[list[Item]], limits: Sequence[int | None], timeout: float | None,
                  num_channels: int, progress: Callable[[int], None],
                  ) -> tuple[list[RequestRecord], list[dict[str, Any]], float]:
    """Each share from a client process of its own: all records, each process's info, the start time."""
    num_procs = len(shares)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    go = ctx.Event()
    start_val = ctx.Value("d", 0.0)
    children = [ctx.Process(target=_child_main, daemon=True, name=f"bench-client-{p}",
                            args=(p, address, shares[p], limits[p], timeout, num_channels, q, go, start_val))
                for p in range(num_procs)]
    for c in children:
        c.start()
    try:
        results = _collect(q, children, go, start_val, progress)
        for c in children:
            c.join(timeout=10)
    finally:
        for c in children:
            if c.is_alive():
                c.terminate()
    records = [r for p in range(num_procs) for r in results[p][0]]
    return records, [results[p][1] for p in range(num_procs)], start_val.value


def run_load(address: str, requests: Sequence[BenchRequest], offsets: Collection[float], *,
             max_concurrency: int | None = None, num_procs: int = 1, timeout: float | None = 600.0,
             channels_per_proc: int = 4, pbar=None) -> LoadResult:
    """Send ``requests[i]`` at ``start + offsets[i]`` (limited to ``max_concurrency`` in flight),
    and not before the request it follows (``BenchRequest.after``) has ended."""
    if len(requests) != len(offsets):
        raise ValueError("one offset per request")
    if num_procs < 1:
        raise ValueError("num_procs must be >= 1")
    num_procs = min(num_procs, max(1, len(requests)))
    items = [(i, r, float(o)) for i, (r, o) in enumerate(zip(requests, offsets))]
    shares = _shares(items, num_procs)
    limits = split_concurrency(max_concurrency, num_procs)
    update = (lambda n: pbar.update(n)) if pbar is not None else (lambda n: None)
    if num_procs == 1:
        records, procs, start_at = _run_here(address, items, limits[0], timeout, channels_per_proc, update)
    else:
        records, procs, start_at = _run_children(address, shares, limits, timeout, channels_per_proc, update)
    records.sort(key=lambda r: r.index)
    end = max((r.end_time for r in records), default=start_at)
    duration = max(end - start_at, 1e-9)
    return LoadResult(records, start_at, duration, _client_summary(records, procs, channels_per_proc))


def single_request(address: str, request: BenchRequest, timeout: float = 120.0) -> RequestRecord:
    """One request, synchronously (warm-up and readiness checks)."""
    res = run_load(address, [request], [0.0], timeout=timeout, channels_per_proc=1)
    return res.records[0]
