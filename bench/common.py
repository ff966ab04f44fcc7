"""Helpers every benchmark shares: result files, device description, bandwidth probe."""
from __future__ import annotations

import datetime
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from pdserve.common import env

logger = logging.getLogger(__name__)
RESULTS_DIR = Path(__file__).parent / "results"


def git_commit() -> str:
    """HEAD, or ``PDSERVE_GIT_COMMIT`` where the tree has no .git (the device machines)."""
    if env.get("GIT_COMMIT"):
        return env.get("GIT_COMMIT")
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def write_result(path: str | Path, result: dict) -> Path:
    """Write ``result`` with device, date, command and commit to ``path`` (JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"device": device_name(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "commit": git_commit(),
              "torch": torch.__version__,
              # the settings this run had from the environment (e.g. PDSERVE_DATAFLOW_DECODE)
              "env": env.snapshot(), **result}
    path.write_text(json.dumps(record, indent=2))
    logger.info("wrote %s", path)
    return path


def copy_bandwidth(num_bytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median)."""
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    times.sort()
    del src, dst
    return 2 * num_bytes / times[len(times) // 2]


def matmul_throughput(n: int = 8192, iters: int = 20) -> float:
    """Dense bf16 GEMM throughput in FLOP/s (an n x n x n product, median of ``iters``): the
    compute ceiling a prefill step can reach on this device, measured like copy_bandwidth."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(iters + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    times.sort()
    del a, b
    return 2 * n ** 3 / times[len(times) // 2]


def gpu_pair_channel(rank: int, addr_q, name: str, timeout: float):
    """For a two-process GPU probe: bind this process to ``cuda:rank`` and join a pair channel
    named ``name`` (rank 1 hosts the store and hands its address to rank 0 through ``addr_q``).
    Returns ``(device, channel, store)``; keep the store referenced while the channel is used."""
    from pdserve.common.kv_transfer import KvStoreServer
    from pdserve.common.kv_transfer.channel import PairChannel
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    store = None
    if rank == 1:
        store = KvStoreServer("127.0.0.1", 0)
        addr_q.put(store.address)
        addr = store.address
    else:
        addr = addr_q.get(timeout=60)
    ch = PairChannel(addr, f"{name}-p", f"{name}-d", 1, rank, dev, timeout=timeout)
    return dev, ch, store


def capture_graph(fn, calls: int = 1) -> torch.cuda.CUDAGraph:
    """``fn`` run three times on a side stream (warm-up, compiles), then captured ``calls`` times
    into one CUDA graph, replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    return graph


def profile_kernels(run) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of the GPU kernels of one call of ``run`` under torch.profiler
    (CUPTI: each kernel's start and end on the GPU), in start order."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    finally:
        os.unlink(path)
    ks = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") == "kernel"]
    return sorted(ks, key=lambda k: k[1])


def graph_time(fn, calls: int = 1, replays: int = 10) -> float:
    """Seconds per call of ``fn``, captured ``calls`` times into one CUDA graph and replayed
    ``replays`` times (median replay): the GPU's own time, no host launch cost in the figure."""
    graph = capture_graph(fn, calls)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]
