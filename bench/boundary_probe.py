"""Lab probe: what one kernel boundary costs inside a CUDA graph, against one grid-wide barrier
inside a persistent kernel.

W-nano's decode steps pay ~1.08 ms each over their bytes floor at every batch size (bench/NOTES.md,
run 8 and the step model), spread over ~258 dependent kernels. A persistent decode layer (one
kernel per layer or per step, phases separated by grid barriers) only helps if a barrier costs
much less than a kernel boundary. This probe times, over ``--phases`` dependent phases:

- ``graph_touch``: that many launches of a kernel that reads and writes 1 KiB per program, one
  program per SM, captured in one graph: the bare cost of a boundary;
- ``graph_rms_norm``: that many launches of the engine's RMSNorm kernel on a [256, 1024] batch;
- ``persistent_touch`` / ``persistent_rms_norm``: the same work as phases of one persistent kernel
  (one program per SM), each phase ended by a grid barrier (an atomic counter and a spin);
- ``graph_rms_norm_chain`` / ``graph_rms_norm_chain_pdl``: one probe RMSNorm kernel in a chain
  (each launch norms what the previous one wrote, checked against torch), plain and with
  programmatic dependent launch (each kernel releases the next at its start and waits in
  ``gdc_wait`` for the one before); ``graph_touch_pdl``: the touch kernel with PDL.

Each variant is checked against torch before it is timed. A barrier that never completes (the
programs were not all resident) gives up after a bounded spin and counts a timeout; the probe
fails if any barrier timed out, in the checks or while timed.

    python -m bench.boundary_probe --out bench/results/boundary_probe/boundary_probe_h100.json
"""
from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench.cold_weights import rms_norm_kernel, rms_norm_row
from bench.common import graph_time, write_result
from pdserve.common.ops.fused import rms_norm

SPIN_LIMIT = tl.constexpr(1 << 22)   # bounded spin: a missing program fails the check instead of hanging


@triton.jit
def _touch_kernel(x_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()     # the next kernel may be scheduled now ...
        tl.extra.cuda.gdc_wait()                  # ... and waits here for this one's whole grid
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Every program adds 1 to ``counter_ptr[0]``, then waits until it reaches ``target``
    (phase * programs); a wait given up after ``SPIN_LIMIT`` spins adds 1 to ``counter_ptr[1]``."""
    tl.debug_barrier()                                          # this program's stores are issued
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    if spins >= SPIN_LIMIT:                                     # counter_ptr[1]: barriers given up
        tl.atomic_add(counter_ptr + 1, 1)


@triton.jit
def _persistent_touch_kernel(x_ptr, counter_ptr, num_phases, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    for phase in range(num_phases):
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1.0)
        _grid_barrier(counter_ptr, (phase + 1) * tl.num_programs(0))


@triton.jit
def _persistent_rms_norm_kernel(x_ptr, w_ptr, out_ptr, counter_ptr, num_rows, n_cols, eps, num_phases,
                                BLOCK: tl.constexpr):
    """Phase ``p`` norms ``x`` into ``out[p % 2]`` (rows dealt round robin), like one engine
    RMSNorm kernel per phase (the row helper reloads the weight per row, as that kernel does)."""
    for phase in range(num_phases):
        dst = out_ptr + (phase % 2) * num_rows * n_cols
        for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
            rms_norm_row(x_ptr, w_ptr, dst, row, n_cols, eps, BLOCK)
        _grid_barrier(counter_ptr, (phase + 1) * tl.num_programs(0))


def timed(fn: Callable[[], None], phases: int) -> dict:
    seconds = graph_time(fn, calls=1, replays=20)
    return {"total_us": 1e6 * seconds, "per_phase_us": 1e6 * seconds / phases}


def touch_variants(phases: int, programs: int, counter: torch.Tensor) -> dict:
    """Bare boundaries: graph launches (plain, PDL) against a persistent kernel's barriers."""
    block = 256
    x = torch.zeros(programs * block, device="cuda")

    def graph_touch(pdl: bool) -> Callable[[], None]:
        extra = {"launch_pdl": True} if pdl else {}

        def run() -> None:
            for _ in range(phases):
                _touch_kernel[(programs,)](x, BLOCK=block, PDL=pdl, num_warps=4, **extra)
        return run

    def persistent_touch() -> None:
        counter[0].zero_()
        _persistent_touch_kernel[(programs,)](x, counter, phases, BLOCK=block, num_warps=4)

    ways = {"graph_touch": graph_touch(False), "graph_touch_pdl": graph_touch(True),
            "persistent_touch": persistent_touch}
    for name, fn in ways.items():                               # each adds `phases` to every element
        x.zero_()
        fn()
        torch.cuda.synchronize()
        assert torch.all(x == phases), f"{name}: {x.min().item()}..{x.max().item()} != {phases}"
    return {name: timed(fn, phases) for name, fn in ways.items()}


def norm_variants(phases: int, programs: int, counter: torch.Tensor) -> dict:
    """RMSNorm [256, 1024] per phase: engine kernel launches, a dependent chain of the probe
    kernel (plain, PDL), and a persistent kernel's phases."""
    rows, hidden = 256, 1024
    h = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2, rows, hidden, device="cuda", dtype=torch.bfloat16)

    def graph_rms_norm() -> None:
        for _ in range(phases):
            rms_norm(h, w, 1e-6)

    def chain(pdl: bool, n: int = phases) -> Callable[[], None]:
        extra = {"launch_pdl": True} if pdl else {}

        def run() -> None:                      # phase p norms what phase p-1 wrote
            for p in range(n):
                src = h if p == 0 else out[(p - 1) % 2]
                rms_norm_kernel[(rows,)](src, w, out[p % 2], hidden, 1e-6, BLOCK=hidden, PDL=pdl,
                                         num_warps=4, **extra)
        return run

    def persistent_rms_norm() -> None:
        counter[0].zero_()
        _persistent_rms_norm_kernel[(programs,)](h, w, out, counter, rows, hidden, 1e-6, phases,
                                                 BLOCK=hidden, num_warps=4)

    out.fill_(float("nan"))
    persistent_rms_norm()
    torch.testing.assert_close(out[(phases - 1) % 2].float(), _norm_chain_ref(h, w, 1), rtol=2e-2, atol=2e-2)
    checked = 6                                 # the ordering of a chain must hold, with PDL too
    for pdl in (False, True):
        out.fill_(float("nan"))
        chain(pdl, checked)()
        torch.testing.assert_close(out[(checked - 1) % 2].float(), _norm_chain_ref(h, w, checked),
                                   rtol=2e-2, atol=2e-2)
    ways = {"graph_rms_norm": graph_rms_norm, "graph_rms_norm_chain": chain(False),
            "graph_rms_norm_chain_pdl": chain(True), "persistent_rms_norm": persistent_rms_norm}
    return {name: timed(fn, phases) for name, fn in ways.items()}


def _norm_chain_ref(h: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` RMSNorms in a row with the kernels' numerics (normed rounded before the weight)."""
    x = h.float()
    for _ in range(n):
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16().float()
        x = (normed * w.float()).bfloat16().float()
    return x


def probe(phases: int, programs: int) -> dict:
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")   # [barrier count, barriers given up]
    result = {"phases": phases, "programs": programs, **touch_variants(phases, programs, counter),
              **norm_variants(phases, programs, counter)}
    torch.cuda.synchronize()
    assert counter[1].item() == 0, f"{counter[1].item()} grid barriers gave up (programs not all resident)"
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phases", type=int, default=280, help="dependent phases (~kernels of a decode step)")
    p.add_argument("--out", default="bench/results/boundary_probe.json")
    args = p.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    points = [probe(args.phases, programs) for programs in (sms, sms // 2)]
    for pt in points:
        print(f"programs={pt['programs']}: " + ", ".join(
            f"{k} {pt[k]['per_phase_us']:.2f} us/phase" for k in
            ("graph_touch", "graph_touch_pdl", "persistent_touch", "graph_rms_norm", "graph_rms_norm_chain",
             "graph_rms_norm_chain_pdl", "persistent_rms_norm")))
    write_result(args.out, {"sm_count": sms, "points": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
