"""Lab probe: does prefetching a projection's weight into L2 from the small kernel before it
(RMSNorm, SiLU-mul) take the DRAM start-up out of the cuBLAS GEMM that follows?

bench/gemm_triton_probe.py found the decode projections cost ~4.5 us over their bytes floor
each with the weights in DRAM (27-30 us a 0.6B layer for a 10.6 us floor), and
bench/gemm_shapes.py 19.6-27.6 us with the weights in L2. This probe times the pair
"norm kernel -> F.linear" with the weight cycled over copies that overflow L2, three ways:

- ``base``: the engine's RMSNorm (one program per row), then the GEMM;
- ``grid``: a probe RMSNorm on ``max(rows, --programs)`` programs (extra programs idle), then the
  GEMM (the cost of the wider grid alone);
- ``bulk`` / ``lines``: the same kernel, every program also prefetching its slice of the GEMM's
  weight into L2, by ``cp.async.bulk.prefetch.L2`` (one range per thread) or by
  ``prefetch.global.L2::evict_last`` (one 128-byte line per instruction).

Each variant's GEMM output is checked against the base pair before timing.

    python -m bench.l2_prefetch_probe --out bench/results/gemm_cold/l2_prefetch_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.cold_weights import THREADS, describe, rms_norm_row, time_ways, weight_copies
from bench.common import copy_bandwidth, write_result
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops.fused import rms_norm


@triton.jit
def _prefetch_slice(w_ptr, w_bytes, pid, nprog, MODE: tl.constexpr):
    """Prefetch program ``pid``'s share of ``w_bytes`` bytes at ``w_ptr`` (16-byte aligned) into L2."""
    per_prog = tl.cdiv(tl.cdiv(w_bytes, nprog), 16 * THREADS) * 16 * THREADS
    per_thread = per_prog // THREADS
    t = tl.arange(0, THREADS)
    start = pid.to(tl.int64) * per_prog + t.to(tl.int64) * per_thread
    size = tl.minimum(tl.maximum(w_bytes - start, 0), per_thread).to(tl.int32)
    base = w_ptr.to(tl.pointer_type(tl.int8))
    if MODE == 1:
        addr = (base + start).to(tl.int64)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for line in range(0, per_thread, 128):
            addr = (base + start + line).to(tl.int64)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [addr, size - line], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _norm_prefetch_kernel(x_ptr, w_ptr, out_ptr, rows, n_cols, eps, pf_ptr, pf_bytes,
                          BLOCK: tl.constexpr, MODE: tl.constexpr):
    """RMSNorm of row ``pid`` (``pid < rows``); MODE 0: nothing else, 1: bulk, 2: line prefetch."""
    pid = tl.program_id(0)
    if MODE != 0:
        _prefetch_slice(pf_ptr, pf_bytes, pid, tl.num_programs(0), MODE)
    if pid < rows:
        rms_norm_row(x_ptr, w_ptr, out_ptr, pid, n_cols, eps, BLOCK)


def pair_us(name: str, n: int, k: int, m: int, programs: int, cold_bytes: int) -> dict:
    ws = weight_copies(n, k, cold_bytes)
    copies = len(ws)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    ref = F.linear(rms_norm(x, g, 1e-6), ws[0])

    def base(i: int) -> torch.Tensor:
        return F.linear(rms_norm(x, g, 1e-6), ws[i])

    def variant(mode: int):
        def run(i: int) -> torch.Tensor:
            _norm_prefetch_kernel[(max(m, programs),)](x, g, normed, m, k, 1e-6, ws[i], n * k * 2,
                                                       BLOCK=triton.next_power_of_2(k), MODE=mode, num_warps=4)
            return F.linear(normed, ws[i])
        return run

    row = {"gemm": name, "M": m, "N": n, "K": k, "copies": copies, "programs": max(m, programs)}
    row.update(time_ways({"base": base, "grid": variant(0), "bulk": variant(1), "lines": variant(2)}, ref, copies,
                         poison=(normed,)))
    print(f"{name:8s} M={m:4d}: " + describe(row, ["base", "grid", "bulk", "lines"]))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="1,16,64,128,256")
    p.add_argument("--programs", type=int, default=132, help="least programs of the norm kernel")
    p.add_argument("--cold-mb", type=int, default=128)
    p.add_argument("--out", default="bench/results/l2_prefetch_probe.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    shapes = gemm_shapes(args.model)
    rows = [pair_us(name, *shapes[name], int(m), args.programs, args.cold_mb << 20)
            for name in ("qkv", "gate_up") for m in args.batches.split(",")]
    errors = [r for r in rows if any(k.endswith("_error") for k in r)]
    if errors:
        print("errors:", {k: v for k, v in errors[0].items() if k.endswith("_error")})
    write_result(args.out, {"model": args.model, "copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
