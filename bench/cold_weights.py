"""Lab helpers shared by the cold-weight probes (bench/gemm_triton_probe.py, l2_prefetch_probe.py,
pdl_gemm_probe.py, boundary_probe.py): weights cycled over copies that overflow L2 (as a decode
step reads them, from DRAM), timing of several ways of one computation against a reference, and
the Triton pieces they combine: an RMSNorm row with the engine's numerics, a tiled GEMM with
optional programmatic dependent launch, and an L2 prefetch of a weight's rows.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bench.common import graph_time, write_result

THREADS = tl.constexpr(128)        # 4 warps: one prefetch range per thread


@triton.jit
def rms_norm_row(x_ptr, w_ptr, out_ptr, row, n_cols, eps, BLOCK: tl.constexpr):
    """``out[row] = w * norm(x[row])`` for contiguous ``[rows, n_cols]`` (fp32 statistics, dtype
    rounding before the weight, as pdserve.common.ops.fused.rms_norm)."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row per program; ``PDL``: release the next kernel at the start, wait for the previous."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    rms_norm_row(x_ptr, w_ptr, out_ptr, tl.program_id(0), n_cols, eps, BLOCK)


@triton.jit
def prefetch_rows_l2(w_ptr, row0, num_rows, K):
    """Prefetch rows ``[row0, row0 + num_rows)`` of a contiguous bf16 ``[*, K]`` matrix into L2
    (``cp.async.bulk.prefetch.L2``, one range per thread; the range must split into 16-byte
    multiples)."""
    per_thread = num_rows * K * 2 // THREADS
    t = tl.arange(0, THREADS).to(tl.int64)
    base = w_ptr.to(tl.pointer_type(tl.int8)) + row0.to(tl.int64) * K * 2
    tl.inline_asm_elementwise("{ cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                              "=r,l,r", [(base + t * per_thread).to(tl.int64), (t * 0 + per_thread).to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def linear_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_am, stride_wn, stride_cm,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  PDL: tl.constexpr = False, PREFETCH: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    """``c[M, N] = a[M, K] @ w[N, K]^T`` (N % BN == 0, K % BK == 0). ``PDL``: release the next
    kernel at the start, wait for the previous one before reading ``a``; ``PREFETCH``: first
    prefetch this program's weight rows into L2; ``PRELOAD`` (K == 2 * BK): load this program's
    whole weight slice into registers before the wait."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        if pid_m == 0:
            prefetch_rows_l2(w_ptr, pid_n * BN, BN, K)
    if PRELOAD:
        w0 = tl.load(w_ptrs)                    # [BN, BK]: needs nothing from the kernel before
        w1 = tl.load(w_ptrs + BK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if PRELOAD:
        acc = tl.dot(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), tl.trans(w0), acc)
        acc = tl.dot(tl.load(a_ptrs + BK, mask=m_mask[:, None], other=0.0), tl.trans(w1), acc)
    else:
        for _ in range(0, K, BK):
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            acc = tl.dot(a, tl.trans(tl.load(w_ptrs)), acc)
            a_ptrs += BK
            w_ptrs += BK
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def linear(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple[int, int, int, int, int],
           pdl: bool = False, prefetch: bool = False, preload: bool = False) -> torch.Tensor:
    """``linear_kernel`` with tile ``cfg = (BM, BN, BK, stages, warps)``; returns ``out``."""
    bm, bn, bk, stages, warps = cfg
    (M, K), N = x.shape, w.shape[0]
    assert not preload or K == 2 * bk, (K, bk)
    extra = {"launch_pdl": True} if pdl else {}
    linear_kernel[(N // bn, triton.cdiv(M, bm))](x, w, out, M, N, K, x.stride(0), w.stride(0), out.stride(0),
                                                 BM=bm, BN=bn, BK=bk, PDL=pdl, PREFETCH=prefetch, PRELOAD=preload,
                                                 num_stages=stages, num_warps=warps, **extra)
    return out


def weight_copies(n: int, k: int, cold_bytes: int) -> list[torch.Tensor]:
    """Enough ``[n, k]`` bf16 weights (at least two) to overflow ``cold_bytes`` of cache."""
    copies = max(2, -(-cold_bytes // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]


def time_cold(fn_for_copy: Callable[[int], object], copies: int) -> float:
    """Seconds per call, the calls cycling over ``copies`` weights in one graph (each from DRAM)."""
    def cycle() -> None:
        for i in range(copies):
            fn_for_copy(i)
    return graph_time(cycle, calls=1, replays=10) / copies


def time_ways(ways: dict[str, Callable[[int], torch.Tensor]], ref: torch.Tensor, copies: int,
              poison: tuple[torch.Tensor, ...] = ()) -> dict:
    """``{label}_us`` for each way that matches ``ref`` on copy 0 (checked first, with the
    ``poison`` buffers the ways write into filled with NaN before), else ``{label}_error`` (a way
    that fails to compile or to match is recorded, not fatal)."""
    row: dict = {}
    for label, fn in ways.items():
        try:
            for t in poison:
                t.fill_(float("nan"))
            torch.testing.assert_close(fn(0), ref, rtol=2e-2, atol=2e-2)
            row[f"{label}_us"] = 1e6 * time_cold(fn, copies)
        except Exception as e:                                   # noqa: BLE001 (record, go on)
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def describe(row: dict, labels: list[str]) -> str:
    return ", ".join(f"{lab} {row[f'{lab}_us']:.2f}" if f"{lab}_us" in row else f"{lab} ERROR" for lab in labels)


def write_rows(out: str, model: str, rows: list[dict]) -> None:
    """Print the first way that failed (compile or check), if any, and write the rows' JSON."""
    errors = [{k: v for k, v in r.items() if k.endswith("_error")} for r in rows]
    if any(errors):
        print("errors:", next(e for e in errors if e))
    write_result(out, {"model": model, "rows": rows})
