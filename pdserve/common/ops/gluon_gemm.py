"""Hopper GEMMs of the decode chain at ``MAX_ROWS + 1`` to ``WIDE_ROWS`` rows, written in Gluon
(pdserve/common/models/dataflow_decode.py; tile shapes in pdserve/common/ops/gemm_tiles.py).

Between 33 and 256 rows a decode step's projections are still short kernels (cuBLAS takes 8-13 us
for weights whose bytes need 1.4-4 us on an H100), and the Triton chain's register tiles cannot
hold a weight slice for that many rows. A program here first starts TMA copies of its first
``stages`` weight tiles into shared memory, which need nothing from earlier kernels, then releases
the next kernel and waits for the one before (programmatic dependent launch, pdserve/common/ops/pdl.py),
then streams its activation tiles and the rest of the weight through the ring into warp-group
MMAs. The weight reads overlap the kernels before it (bench/NOTES.md run 45: norm -> GEMM pairs
6.3-8.1 us against cuBLAS's 7.9-9.0 for QKV at 64-256 rows).

Three entry points, all ``a: [M, K]`` against ``w: [N, K]`` (``a @ w.T``), any M:

- ``linear`` -> ``[M, N]`` in a's dtype (rounded as cuBLAS rounds its output);
- ``splitk`` -> fp32 partial sums ``[splits, Mp, N]``, ``Mp`` = M rounded up to the M tile (TMA
  clips a store only at the end of the whole tensor, so every split owns whole tiles); rows
  ``M..Mp`` of each split are zeros' products and not read;
- ``silu_linear`` with ``w = [gate; up]`` (``[2 I, K]``) -> ``silu(gate) * up`` ``[M, I]``: a
  program computes the gate and the up tile of the same columns and multiplies them in its
  epilogue, each rounded to a's dtype first, where the unfused path rounds its GEMM output.

Rules: a GPU of compute capability 9.x (warp-group MMA, TMA); a Triton with Gluon; half-precision
``a`` and ``w``, both contiguous; the tile constraints of ``Tiles.fits``. Rows of ``a`` past M are
read as zeros by TMA (correct, but 30-50% slower than whole tiles: callers pass ``a`` of whole M
tiles, gemm_tiles.padded_rows); ``linear`` and ``silu_linear`` store only M rows, ``splitk`` all
``Mp``.
"""
from __future__ import annotations

import functools

import torch
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

from pdserve.common.ops.gemm_tiles import Tiles

# Triton 3.6 names the TMA copies async_copy_*; later releases async_load / async_store
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


@gluon.jit
def _griddep(ASM: gl.constexpr):
    gl.inline_asm_elementwise(ASM, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _load_w(w_desc, w_bufs, bar, slot, off_n, up_row, k, WT: gl.constexpr):
    """The weight tile(s) of one K step into ring slot ``slot``: columns ``off_n``, and with
    ``WT == 2`` also the up tile ``up_row`` rows further."""
    mbarrier.expect(bar.index(slot), WT * w_desc.block_type.nbytes)
    _tma_load(w_desc, [off_n, k], bar.index(slot), w_bufs.index(slot * WT))
    if WT == 2:
        _tma_load(w_desc, [up_row + off_n, k], bar.index(slot), w_bufs.index(slot * WT + 1))


@gluon.jit
def _load_a(a_desc, a_bufs, bar, slot, off_m, k):
    mbarrier.expect(bar.index(slot), a_desc.block_type.nbytes)
    _tma_load(a_desc, [off_m, k], bar.index(slot), a_bufs.index(slot))


@gluon.jit
def _gemm_kernel(a_desc, w_desc, c_desc, K, OUT_ROWS, UP_ROW, STAGES: gl.constexpr, SILU: gl.constexpr,
                 OVERLAP: gl.constexpr, PDL: gl.constexpr, M_FAST: gl.constexpr, num_warps: gl.constexpr):
    """Program (n, m, s) (``M_FAST``: (m, n, s), so that the programs of one weight tile launch
    together): output tile rows ``s * OUT_ROWS + m * BM``, columns ``n * BN``, over columns
    ``s * K .. (s + 1) * K`` of a and w (``K`` a multiple of BK)."""
    BM: gl.constexpr = c_desc.block_type.shape[0]
    BN: gl.constexpr = c_desc.block_type.shape[1]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    WT: gl.constexpr = 2 if SILU else 1                    # weight tiles per K step
    if M_FAST:
        off_m = gl.program_id(0) * BM
        off_n = gl.program_id(1) * BN
    else:
        off_n = gl.program_id(0) * BN
        off_m = gl.program_id(1) * BM
    k0 = gl.program_id(2) * K
    n_k = K // BK
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES * WT, BN, BK], w_desc.layout)
    w_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    a_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(w_bar.index(s), count=1)
        mbarrier.init(a_bar.index(s), count=1)
    for s in gl.static_range(STAGES):                      # the weight needs nothing from earlier kernels
        if s < n_k:
            _load_w(w_desc, w_bufs, w_bar, s, off_n, UP_ROW, k0 + s * BK, WT)
    if PDL:
        _griddep("griddepcontrol.launch_dependents; mov.u32 $0, 0;")
        _griddep("griddepcontrol.wait; mov.u32 $0, 0;")
    for s in gl.static_range(STAGES):
        if s < n_k:
            _load_a(a_desc, a_bufs, a_bar, s, off_m, k0 + s * BK)
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    acc_up = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
    for i in range(n_k):
        slot = i % STAGES
        phase = (i // STAGES) & 1
        mbarrier.wait(w_bar.index(slot), phase)
        mbarrier.wait(a_bar.index(slot), phase)
        acc = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot * WT).permute((1, 0)), acc, is_async=True)
        if SILU:
            acc_up = warpgroup_mma(a_bufs.index(slot), w_bufs.index(slot * WT + 1).permute((1, 0)), acc_up,
                                   is_async=True)
        if OVERLAP:                                        # step i's MMAs run on while step i - 1's slot refills
            if SILU:
                acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            done = i - 1
        else:
            if SILU:
                acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
            else:
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            done = i
        nxt = done + STAGES
        if (done >= 0) & (nxt < n_k):                      # refill the slot whose MMAs have finished
            ds = done % STAGES
            _load_w(w_desc, w_bufs, w_bar, ds, off_n, UP_ROW, k0 + nxt * BK, WT)
            _load_a(a_desc, a_bufs, a_bar, ds, off_m, k0 + nxt * BK)
    if SILU:
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc_up))
    else:
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(w_bar.index(s))
        mbarrier.invalidate(a_bar.index(s))
    out_dtype: gl.constexpr = c_desc.dtype
    if SILU:
        gate = acc.to(out_dtype).to(gl.float32)
        up = acc_up.to(out_dtype).to(gl.float32)
        out = (gate / (1.0 + gl.exp(-gate)) * up).to(out_dtype)
    else:
        out = acc.to(out_dtype)
    c_smem = gl.allocate_shared_memory(out_dtype, [BM, BN], c_desc.layout)
    c_smem.store(out)
    fence_async_shared()
    _tma_store(c_desc, [gl.program_id(2) * OUT_ROWS + off_m, off_n], c_smem)
    tma.store_wait(0)


@functools.lru_cache(maxsize=64)
def _layout(block: tuple[int, int], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


def _desc(t: torch.Tensor, block: tuple[int, int]) -> TensorDescriptor:
    """A TMA descriptor over the 2-D tensor ``t`` in ``block`` tiles."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), list(block), _layout(block, t.dtype))


def _check(a: torch.Tensor, w: torch.Tensor, tiles: Tiles, n: int) -> None:
    assert a.dim() == 2 and w.dim() == 2 and a.shape[1] == w.shape[1], (a.shape, w.shape)
    assert a.is_contiguous() and w.is_contiguous() and a.dtype == w.dtype, (a.dtype, w.dtype)
    assert a.dtype in (torch.bfloat16, torch.float16), a.dtype
    assert tiles.fits(n, a.shape[1]), (tiles, n, a.shape[1])


def _launch(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, tiles: Tiles, n_tiles: int, out_rows: int,
            up_row: int, silu: bool, pdl: bool) -> None:
    m, k = a.shape
    m_tiles = triton.cdiv(m, tiles.bm)
    grid = (m_tiles, n_tiles, tiles.splits) if tiles.m_fast else (n_tiles, m_tiles, tiles.splits)
    _gemm_kernel[grid](_desc(a, (tiles.bm, tiles.bk)), _desc(w, (tiles.bn, tiles.bk)), _desc(c, (tiles.bm, tiles.bn)),
                       k // tiles.splits, out_rows, up_row, STAGES=tiles.stages, SILU=silu, OVERLAP=tiles.overlap,
                       PDL=pdl, M_FAST=tiles.m_fast, num_warps=4, **({"launch_pdl": True} if pdl else {}))


def linear(a: torch.Tensor, w: torch.Tensor, tiles: Tiles, pdl: bool = True) -> torch.Tensor:
    """a: [M, K], w: [N, K] -> ``a @ w.T``: [M, N] in a's dtype (``tiles.splits`` must be 1)."""
    n = w.shape[0]
    _check(a, w, tiles, n)
    assert tiles.splits == 1, tiles
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    _launch(a, w, out, tiles, n // tiles.bn, 0, 0, False, pdl)
    return out


def splitk(a: torch.Tensor, w: torch.Tensor, tiles: Tiles, pdl: bool = True) -> torch.Tensor:
    """a: [M, K], w: [N, K] -> fp32 partial sums of ``a @ w.T`` over ``tiles.splits`` K ranges:
    [splits, Mp, N], Mp = M rounded up to ``tiles.bm`` (rows past M unused)."""
    n = w.shape[0]
    _check(a, w, tiles, n)
    rows = triton.cdiv(a.shape[0], tiles.bm) * tiles.bm
    part = torch.empty(tiles.splits, rows, n, dtype=torch.float32, device=a.device)
    _launch(a, w, part.view(tiles.splits * rows, n), tiles, n // tiles.bn, rows, 0, False, pdl)
    return part


def silu_linear(a: torch.Tensor, w: torch.Tensor, tiles: Tiles, pdl: bool = True) -> torch.Tensor:
    """a: [M, K], w: [2 I, K] (gate rows, then up) -> ``silu(a @ gate.T) * (a @ up.T)``: [M, I]."""
    inter = w.shape[0] // 2
    _check(a, w, tiles, inter)
    assert tiles.splits == 1 and w.shape[0] == 2 * inter, (tiles, w.shape)
    out = torch.empty(a.shape[0], inter, dtype=a.dtype, device=a.device)
    _launch(a, w, out, tiles, inter // tiles.bn, 0, inter, True, pdl)
    return out
