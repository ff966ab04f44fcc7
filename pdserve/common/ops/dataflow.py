"""Triton kernels of the decode chain's small range, 1 to ``MAX_ROWS`` rows, and the partial-summing
kernels both of its ranges share (pdserve/common/models/dataflow_decode.py).

At a handful of rows a decode step's projections are latency-bound: a GEMM's weight bytes take
less time than the kernel's start and ramp, and a usual kernel starts reading only after the
kernel before it has finished. Here every kernel is launched with programmatic dependent launch
(PDL) and releases the next kernel at its start, and a GEMM program first loads its weight tile
(``BN x BK`` = 32 x 512, 32 KB) into registers, which needs nothing from earlier kernels, then
waits (``gdc_wait``) for its input. The weight reads of a projection then overlap the kernels
before it. Every N tile re-reads the activations, so the range stops at ``MAX_ROWS``.

Rules:
- ``M <= MAX_ROWS`` rows: one ``tl.dot`` takes the whole batch (padded to 16 or 32).
- ``splitk`` splits K into ``BK`` tiles, one a program (grid ``N / BN x K / BK``), and writes
  fp32 partial sums ``part[K / BK, M, N]``; the next kernel adds them up as it reads them
  (``add_norm_partials``, ``silu_partials``; for QKV the qk-norm/RoPE kernel,
  ``fused.qk_norm_rope``), rounding to the activation dtype first, where the unfused path
  rounds its GEMM output.
- ``preload_linear`` (K = BK or K = 2 * BK, M <= PRELOAD_ROWS) holds a program's whole K and
  writes the activation dtype directly (the chain takes it for QKV at <= PRELOAD_ROWS rows).
- Weights are contiguous ``[N, K]``; activations contiguous ``[M, K]``; N % BN == 0, K % BK == 0.
- Without PDL (pdserve/common/ops/pdl.py; or under the interpreter) the same kernels run with
  plain launches.

The timings behind these rules (dense half against cuBLAS by rows, preload against split-K):
bench/notes/decode_chain.md, "Small range".
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.ops.pdl import launch_args, pdl_available

BN, BK = 32, 512          # a weight tile: 32 rows x 512 columns
MAX_ROWS = 32
PRELOAD_ROWS = 16


def _launch(x: torch.Tensor) -> dict:
    return launch_args(pdl_available(x.device))


@triton.jit
def _splitk_kernel(a_ptr, w_ptr, part_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PDL: tl.constexpr = False):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.program_id(1)
    offs_k = ks * BK + tl.arange(0, BK)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :])       # [BN, BK]
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < M
    a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None], other=0.0)
    acc = tl.dot(a, tl.trans(w))                                                   # [BM, BN] fp32
    tl.store(part_ptr + (ks * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _preload_linear_kernel(a_ptr, w_ptr, c_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           KT: tl.constexpr, PDL: tl.constexpr = False):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (KT * BK) + offs_k[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w0 = tl.load(w_ptrs)
    w1 = w0
    if KT > 1:
        w1 = tl.load(w_ptrs + BK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None] * (KT * BK) + offs_k[None, :]
    acc = tl.dot(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), tl.trans(w0))
    if KT > 1:
        acc = tl.dot(tl.load(a_ptrs + BK, mask=m_mask[:, None], other=0.0), tl.trans(w1), acc)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit
def _add_norm_partials_kernel(part_ptr, KS, res_ptr, w_ptr, out_ptr, res_out_ptr, SPLIT_ROWS, n_cols, eps,
                              BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)            # no producer: before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for ks in range(KS):
        acc += tl.load(part_ptr + (ks * SPLIT_ROWS + row) * n_cols + cols, mask=mask, other=0.0)
    res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
    x = acc.to(res.dtype) + res
    tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _silu_partials_kernel(part_ptr, KS, out_ptr, M, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for ks in range(KS):
        base = part_ptr + (ks * M + row) * (2 * inter)
        gate += tl.load(base + cols, mask=mask, other=0.0)
        up += tl.load(base + inter + cols, mask=mask, other=0.0)
    dt = out_ptr.dtype.element_ty
    gate = gate.to(dt).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up.to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, y.to(dt), mask=mask)


def _rows(m: int) -> int:
    assert 1 <= m <= MAX_ROWS, f"{m} rows: the dataflow kernels take 1..{MAX_ROWS}"
    return max(16, triton.next_power_of_2(m))


def splitk(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a: [M, K], w: [N, K] -> fp32 partial sums of ``a @ w.T``: [K / BK, M, N]."""
    (m, k), n = a.shape, w.shape[0]
    assert a.is_contiguous() and w.is_contiguous() and w.shape[1] == k, (a.shape, w.shape)
    assert k % BK == 0 and n % BN == 0, (a.shape, w.shape)
    part = torch.empty(k // BK, m, n, dtype=torch.float32, device=a.device)
    _splitk_kernel[(n // BN, k // BK)](a, w, part, m, n, k, BM=_rows(m), BN=BN, BK=BK, num_warps=4, **_launch(a))
    return part


def preload_linear(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a: [M, K] with K = BK or K = 2 * BK, w: [N, K] -> ``a @ w.T`` in a's dtype: [M, N]."""
    (m, k), n = a.shape, w.shape[0]
    assert a.is_contiguous() and w.is_contiguous() and w.shape[1] == k and k in (BK, 2 * BK) and n % BN == 0
    assert m <= PRELOAD_ROWS, m
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    _preload_linear_kernel[(n // BN,)](a, w, out, m, n, BM=_rows(m), BN=BN, BK=BK, KT=k // BK, num_warps=8,
                                       **_launch(a))
    return out


def add_norm_partials(part: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """part: [S, Mp, H] fp32 (Mp >= M: rows past M, padding of the Gluon GEMMs' tiles, unread),
    residual: [M, H] -> (norm(x) * weight, x) with ``x = round(part[:, :M].sum(0)) + residual``.
    ``out_rows`` (>= M): the normed output gets that many rows, those past M left unwritten (the
    next Gluon GEMM's whole M tiles); x keeps M rows."""
    s, rows, h = part.shape
    m = residual.shape[0]
    assert residual.shape == (m, h) and rows >= m and residual.is_contiguous(), (part.shape, residual.shape)
    assert part.is_contiguous(), part.stride()
    out_rows = m if out_rows is None else out_rows
    assert out_rows >= m, (out_rows, m)
    out = residual.new_empty(out_rows, h)
    res_out = torch.empty_like(residual)
    _add_norm_partials_kernel[(m,)](part, s, residual, weight, out, res_out, rows, h, eps,
                                    BLOCK=triton.next_power_of_2(h), num_warps=4, **_launch(part))
    return out, res_out


def silu_partials(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """part: [S, M, 2 * I] fp32 (gate columns, then up) -> ``silu(gate) * up``: [M, I] in ``dtype``."""
    s, m, two_i = part.shape
    inter = two_i // 2
    out = torch.empty(m, inter, dtype=dtype, device=part.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_partials_kernel[(m, triton.cdiv(inter, block))](part, s, out, m, inter, BLOCK=block, num_warps=4,
                                                         **_launch(part))
    return out
