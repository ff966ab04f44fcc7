"""Lab helpers of bench/step_trace.py: what can stall the host or the GPU inside a timed run.

Triton compiles (through Triton's JIT hooks), Python GC pauses (``gc.callbacks``), device and
pinned-host allocator events, and a CUDA-activity profile of the prefill phase whose kernel
intervals, against their span, give the GPU's idle time between kernels there.
"""
from __future__ import annotations

import gc
import time

import torch


class PrefillKernelTimeline:
    """torch.profiler (CUDA activity only) from the start of the run to the first decode-only
    launch, i.e. over the prefill phase: the union of kernel intervals against their span says
    how long the GPU sat idle between kernels there. Stopping the profiler flushes it once, at
    the switch to decode (the run's wall time includes that)."""

    def __init__(self) -> None:
        from torch.profiler import ProfilerActivity, profile
        self.prof = profile(activities=[ProfilerActivity.CUDA])
        self.running = False

    def start(self) -> None:
        self.prof.start()
        self.running = True

    def on_launch(self, is_prefill: bool) -> None:
        if self.running and not is_prefill:
            torch.cuda.synchronize()
            self.prof.stop()
            self.running = False

    def summary(self) -> dict:
        kernels = [e for e in self.prof.events() if e.device_type.name == "CUDA"]
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        if not spans:
            return {}
        busy, cur_start, cur_end = 0.0, spans[0][0], spans[0][1]
        for a, b in spans[1:]:
            if a > cur_end:
                busy += cur_end - cur_start
                cur_start, cur_end = a, b
            else:
                cur_end = max(cur_end, b)
        busy += cur_end - cur_start
        span = spans[-1][1] - spans[0][0]
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + (e.time_range.end - e.time_range.start)
        top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
        return {"span_ms": span / 1e3, "kernel_busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
                "kernels": len(kernels), "top_kernels_ms": {k: round(v / 1e3, 3) for k, v in top}}


def pinned_allocs() -> tuple[int, float]:
    """(pinned host blocks created so far, microseconds spent creating them)."""
    h = torch.cuda.host_memory_stats()
    return int(h.get("num_host_alloc", 0)), float(h.get("host_alloc_time.total", 0.0))


def track_compiles() -> list[dict]:
    """Triton compiles from now on (a kernel variant first met inside the timed run costs the host
    a compile or a disk-cache load): kernel, its specialization and seconds, in the order they
    happened, through Triton's JIT hooks (``triton.knobs.runtime``)."""
    from triton import knobs
    compiles: list[dict] = []
    started: dict = {}

    def before(*, key, **_kw) -> bool:
        started[str(key)] = time.perf_counter()
        return False                                   # True would skip the compile

    def after(*, key, **kw) -> bool:
        t0 = started.pop(str(key), None)
        compiles.append({"kernel": kw["repr"][:400], "s": None if t0 is None else round(time.perf_counter() - t0, 4)})
        return False
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None, "hooks in use"
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = before, after
    return compiles


def untrack_compiles() -> None:
    from triton import knobs
    knobs.runtime.jit_cache_hook = knobs.runtime.jit_post_compile_hook = None


def track_gc() -> dict:
    """Python garbage-collector pauses from now on: count and seconds per generation (the pauses
    stop the host wherever they strike, a step's launches included)."""
    stats: dict = {"by_generation": {}, "pauses_over_1ms": 0, "callback": None}
    started: list[float] = [0.0]

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        dt = time.perf_counter() - started[0]
        g = stats["by_generation"].setdefault(str(info["generation"]), {"count": 0, "s": 0.0, "max_s": 0.0})
        g["count"] += 1
        g["s"] += dt
        g["max_s"] = max(g["max_s"], dt)
        stats["pauses_over_1ms"] += dt > 1e-3
    gc.callbacks.append(callback)
    stats["callback"] = callback                       # removed with gc.callbacks.remove after the run
    return stats


def allocator_counts() -> dict[str, int]:
    """Device and pinned-host allocator events that can stall the host (cudaMalloc / cudaFree /
    cudaHostAlloc, allocation retries)."""
    dev = torch.cuda.memory_stats()
    out = {k: int(dev.get(k, 0)) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                                            "num_sync_all_streams")}
    host = getattr(torch.cuda, "host_memory_stats", None)
    if host is not None:
        h = host()
        out.update({f"host_{k}": int(h.get(k, 0)) for k in ("num_host_alloc", "num_host_free")})
        out["host_alloc_time_us"] = int(h.get("host_alloc_time.total", 0))
    return out
