"""Lab probe (issue 20): a Hopper GEMM written in Gluon that fetches its weight tiles into shared
memory by TMA *before* it waits (programmatic dependent launch) for the kernel that writes its
input, against cuBLAS, at the 64-256 decode rows where the Triton register-tile chain loses.

Triton's ``tl`` cannot issue a load into shared memory ahead of ``gdc_wait`` (bench/NOTES.md runs
29-30, 33: its loads before the wait land in registers, and whole weight slices do not fit
there beyond 16 rows). Gluon gives the TMA copies and mbarriers explicitly: each program starts
the first ``STAGES`` weight tiles of its N slice, releases the next kernel, waits for the
previous one, then streams its activation tiles and the rest of the weight through a ring of
``STAGES`` buffers into warp-group MMAs.

Timed as (RMSNorm, GEMM) pairs over weights cycled beyond L2, as bench/pdl_gemm_probe.py does,
every way checked against ``F.linear`` of the engine's RMSNorm on fresh random inputs first
(outputs poisoned with NaN):

- ``cublas``: engine RMSNorm -> ``F.linear`` (the engine today);
- ``gluon``: the probe norm -> the Gluon GEMM, plain launches;
- ``gluon_pdl``: both with PDL, the GEMM's first weight tiles in flight before its wait.

    python -m bench.gluon_gemm_probe --out bench/results/gemm_cold/gluon_gemm_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.cold_weights import describe, rms_norm_kernel, time_ways, weight_copies, write_rows
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops.fused import rms_norm


@gluon.jit
def _griddep(ASM: gl.constexpr):
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def prefetch_gemm_kernel(a_desc, w_desc, c_desc, K, M, STAGES: gl.constexpr, PDL: gl.constexpr,
                         OVERLAP: gl.constexpr, num_warps: gl.constexpr):
    """c[M, N] = a[M, K] @ w[N, K]^T, one (BM, BN) tile a program; K % BK == 0, K / BK >= STAGES.
    ``OVERLAP``: one warp-group MMA stays in flight while the slot of the one before refills.
    Split over K when the grid has a third axis: program ``ks`` takes ``K`` columns from ``ks * K``
    and writes its partial tile at rows ``ks * M + off_m`` of ``c`` ([splits * M, N], fp32)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    off_n = gl.program_id(0) * BN
    off_m = gl.program_id(1) * BM
    k0 = gl.program_id(2) * K
    out_row = gl.program_id(2) * M + off_m
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(w_bar.index(s), count=1)
        mbarrier.init(a_bar.index(s), count=1)
    for s in gl.static_range(STAGES):                 # the weight needs nothing from the kernel before
        mbarrier.expect(w_bar.index(s), w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [off_n, k0 + s * BK], w_bar.index(s), w_bufs.index(s))
    if PDL:
        _griddep("griddepcontrol.launch_dependents; mov.u32 $0, 0;")
        _griddep("griddepcontrol.wait; mov.u32 $0, 0;")
    for s in gl.static_range(STAGES):
        mbarrier.expect(a_bar.index(s), a_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [off_m, k0 + s * BK], a_bar.index(s), a_bufs.index(s))
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    n_k = K // BK
    for i in range(n_k):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(w_bar.index(slot), phase)
        mbarrier.wait(a_bar.index(slot), phase)
        acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
        if OVERLAP:                                   # MMA i runs on while step i - 1's slot refills
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            done = i - 1
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            done = i
        nxt = done + STAGES
        if (done >= 0) & (nxt < n_k):                 # refill the slot whose MMA has finished
            ds = done % STAGES
            mbarrier.expect(w_bar.index(ds), w_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(w_desc, [off_n, k0 + nxt * BK], w_bar.index(ds), w_bufs.index(ds))
            mbarrier.expect(a_bar.index(ds), a_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, k0 + nxt * BK], a_bar.index(ds), a_bufs.index(ds))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(w_bar.index(s))
        mbarrier.invalidate(a_bar.index(s))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BM, BN], c_desc.layout)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [out_row, off_n], c_smem)
    tma.store_wait(0)


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32 if t.dtype == torch.float32 else gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


class GluonLinear:
    """``out = x @ w.T`` through ``prefetch_gemm_kernel`` for fixed buffers (descriptors built once);
    with ``splits`` > 1, ``out`` is [splits * M, N] fp32 partial sums."""

    def __init__(self, x: torch.Tensor, ws: list[torch.Tensor], out: torch.Tensor, bm: int, bn: int, bk: int,
                 stages: int, warps: int = 4, overlap: bool = False, splits: int = 1) -> None:
        self.a = _desc(x, [bm, bk])
        self.ws = [_desc(w, [bn, bk]) for w in ws]
        self.c = _desc(out, [bm, bn])
        self.grid = (ws[0].shape[0] // bn, triton.cdiv(x.shape[0], bm), splits)
        self.k, self.m = x.shape[1] // splits, x.shape[0]
        self.stages, self.out, self.warps, self.overlap = stages, out, warps, overlap

    def __call__(self, i: int, pdl: bool) -> torch.Tensor:
        extra = {"launch_pdl": True} if pdl else {}
        prefetch_gemm_kernel[self.grid](self.a, self.ws[i], self.c, self.k, self.m, STAGES=self.stages, PDL=pdl,
                                        OVERLAP=self.overlap, num_warps=self.warps, **extra)
        return self.out


def pair(name: str, n: int, k: int, m: int, cfg: tuple[int, ...], cold_bytes: int) -> dict:
    """cfg: (BM, BN, BK, STAGES, warps, overlap); BM 0 = 64 up to 64 rows, else 128."""
    ws = weight_copies(n, k, cold_bytes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    bm = cfg[0] or (64 if m <= 64 else 128)
    lin = GluonLinear(normed, ws, out, bm, *cfg[1:5], overlap=bool(cfg[5]) if len(cfg) > 5 else False)

    def gluon_pair(i: int, pdl: bool) -> torch.Tensor:
        rms_norm_kernel[(m,)](x, g, normed, k, 1e-6, BLOCK=triton.next_power_of_2(k), PDL=pdl, num_warps=4,
                              **({"launch_pdl": True} if pdl else {}))
        return lin(i, pdl)

    ways = {"cublas": lambda i: F.linear(rms_norm(x, g, 1e-6), ws[i]),
            "gluon": lambda i: gluon_pair(i, False),
            "gluon_pdl": lambda i: gluon_pair(i, True)}
    ref = F.linear(rms_norm(x, g, 1e-6), ws[0])
    row = {"gemm": name, "M": m, "N": n, "K": k, "BM": bm, "BN": cfg[1], "BK": cfg[2], "stages": cfg[3],
           "warps": cfg[4], "overlap": bool(cfg[5]) if len(cfg) > 5 else False,
           "copies": len(ws), **time_ways(ways, ref, len(ws), poison=(normed, out))}
    print(f"{name:8s} M={m:4d} BM={bm:3d} BN={cfg[1]:3d} BK={cfg[2]:3d} S={cfg[3]} W={cfg[4]} O={cfg[5:]}: "
          + describe(row, list(ways)))
    return row


def split_pair(name: str, n: int, k: int, m: int, cfg: tuple[int, ...], splits: int, cold_bytes: int) -> dict:
    """o_proj / down (N = hidden): norm -> GEMM split over K (fp32 partials) -> add + RMSNorm adding
    them up (the product's ``add_norm_partials``), against norm -> ``F.linear`` -> add + RMSNorm."""
    from pdserve.common.ops.dataflow import add_norm_partials
    ws = weight_copies(n, k, cold_bytes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    g2 = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    part = torch.empty(splits * m, n, device="cuda", dtype=torch.float32)
    bm = cfg[0] or (64 if m <= 64 else 128)
    lin = GluonLinear(normed, ws, part, bm, *cfg[1:5], overlap=bool(cfg[5]) if len(cfg) > 5 else False, splits=splits)

    def gluon_chain(i: int) -> torch.Tensor:
        rms_norm_kernel[(m,)](x, g, normed, k, 1e-6, BLOCK=triton.next_power_of_2(k), PDL=True, num_warps=4,
                              launch_pdl=True)
        lin(i, True)
        return add_norm_partials(part.view(splits, m, n), res, g2, 1e-6)[0]

    ways = {"cublas": lambda i: rms_norm(F.linear(rms_norm(x, g, 1e-6), ws[i]), g2, 1e-6, res)[0],
            "gluon_pdl": gluon_chain}
    ref = ways["cublas"](0).clone()
    row = {"gemm": name, "M": m, "N": n, "K": k, "BM": bm, "BN": cfg[1], "BK": cfg[2], "stages": cfg[3],
           "warps": cfg[4], "overlap": bool(cfg[5]) if len(cfg) > 5 else False, "splits": splits, "copies": len(ws),
           **time_ways(ways, ref, len(ws), poison=(normed, part))}
    print(f"{name:8s} M={m:4d} BM={bm:3d} BN={cfg[1]:3d} BK={cfg[2]:3d} S={cfg[3]} split={splits}: "
          + describe(row, list(ways)))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--configs", default="0:32:128:3:4,0:32:64:6:4,0:64:128:3:4",
                   help="BM:BN:BK:STAGES:WARPS[:OVERLAP], comma-separated (BM 0: 64 up to 64 rows, else 128)")
    p.add_argument("--split-configs", default="0:32:128:3:4:0:2,0:32:128:3:4:0:4",
                   help="BM:BN:BK:STAGES:WARPS:OVERLAP:SPLITS for o_proj and down (norm -> GEMM -> add+norm)")
    p.add_argument("--cold-mb", type=int, default=128)
    p.add_argument("--out", default="bench/results/gluon_gemm_probe.json")
    args = p.parse_args(argv)
    shapes = gemm_shapes(args.model)
    configs = [tuple(int(v) for v in c.split(":")) for c in args.configs.split(",")]
    rows = [pair(name, *shapes[name], int(m), cfg, args.cold_mb << 20)
            for name in ("qkv", "gate_up") for m in args.batches.split(",") for cfg in configs]
    split_configs = [tuple(int(v) for v in c.split(":")) for c in args.split_configs.split(",") if c]
    rows += [split_pair(name, *shapes[name], int(m), cfg[:-1], cfg[-1], args.cold_mb << 20)
             for name in ("o_proj", "down") for m in args.batches.split(",") for cfg in split_configs]
    write_rows(args.out, args.model, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
