"""Lab probe: a decode projection as a Triton GEMM launched early (programmatic dependent launch)
that starts fetching its own weight slice into L2 before it waits for its input.

A projection's weight does not depend on the kernel before it. With PDL the GEMM's programs can
be resident while that kernel (an RMSNorm here) still runs: each first prefetches its rows of
the weight (``cp.async.bulk.prefetch.L2``), then waits (``gdc_wait``) for the norm's output, then
multiplies. Timed as chains of (norm, GEMM) pairs over weights cycled beyond L2, each checked
against ``F.linear`` of the engine's RMSNorm:

- ``cublas``: engine RMSNorm -> ``F.linear`` (the engine today);
- ``triton``: the probe norm -> Triton GEMM, plain launches;
- ``pdl``: both with PDL (each releases the next kernel at its start, waits before reading);
- ``pdl_prefetch``: ``pdl`` plus the GEMM's weight prefetch before its wait.

    python -m bench.pdl_gemm_probe --out bench/results/pdl_gemm_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.common import graph_time, write_result
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops.fused import rms_norm

THREADS = tl.constexpr(128)


@triton.jit
def _norm_kernel(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _gemm_kernel(a_ptr, w_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):
    """c[M, N] = a[M, K] @ w[N, K]^T, contiguous rows (N % BN == 0, K % BK == 0)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    if PREFETCH:
        if pid_m == 0:                           # this program's BN weight rows: one contiguous range
            per_thread = BN * K * 2 // THREADS
            t = tl.arange(0, THREADS).to(tl.int64)
            base = w_ptr.to(tl.pointer_type(tl.int8)) + pid_n.to(tl.int64) * BN * K * 2
            addr = (base + t * per_thread).to(tl.int64)
            tl.inline_asm_elementwise("{ cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                                      "=r,l,r", [addr, (t * 0 + per_thread).to(tl.int32)],
                                      dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_mask = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for _ in range(0, K, BK):
        a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(tl.load(w_ptrs)), acc)
        a_ptrs += BK
        w_ptrs += BK
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None])


def tile(m: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, stages, warps) from bench/gemm_triton_probe.py's best configs."""
    if m <= 16:
        return 16, 32, 128, 4, 4
    if m <= 64:
        return 64, 32, 128, 4, 4
    return 64, 64, 128, 4, 4


def chain(name: str, n: int, k: int, m: int, cold_bytes: int) -> dict:
    dev = torch.device("cuda")
    copies = max(2, -(-cold_bytes // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    g = torch.randn(k, device=dev, dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
    bm, bn, bk, stages, warps = tile(m)

    def triton_pair(i: int, pdl: bool, prefetch: bool) -> torch.Tensor:
        extra = {"launch_pdl": True} if pdl else {}
        _norm_kernel[(m,)](x, g, normed, k, 1e-6, BLOCK=triton.next_power_of_2(k), PDL=pdl, num_warps=4, **extra)
        _gemm_kernel[(n // bn, triton.cdiv(m, bm))](normed, ws[i], out, m, n, k, BM=bm, BN=bn, BK=bk, PDL=pdl,
                                                    PREFETCH=prefetch, num_stages=stages, num_warps=warps,
                                                    **extra)
        return out

    ways = {"cublas": lambda i: F.linear(rms_norm(x, g, 1e-6), ws[i]),
            "triton": lambda i: triton_pair(i, False, False),
            "pdl": lambda i: triton_pair(i, True, False),
            "pdl_prefetch": lambda i: triton_pair(i, True, True)}
    ref = F.linear(rms_norm(x, g, 1e-6), ws[0])
    row = {"gemm": name, "M": m, "N": n, "K": k, "copies": copies, "tile": [bm, bn, bk, stages, warps]}
    for label, fn in ways.items():
        try:
            torch.testing.assert_close(fn(0), ref, rtol=2e-2, atol=2e-2)

            def cycle(fn=fn) -> None:
                for i in range(copies):
                    fn(i)
            row[f"{label}_us"] = 1e6 * graph_time(cycle, calls=1, replays=10) / copies
        except Exception as e:                                   # noqa: BLE001 (record, go on)
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"{name:8s} M={m:4d}: " + ", ".join(f"{lab} {row[f'{lab}_us']:.2f}" if f"{lab}_us" in row
                                              else f"{lab} ERROR" for lab in ways))
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="1,16,64,128,256")
    p.add_argument("--cold-mb", type=int, default=128)
    p.add_argument("--out", default="bench/results/pdl_gemm_probe.json")
    args = p.parse_args(argv)
    shapes = gemm_shapes(args.model)
    rows = [chain(name, *shapes[name], int(m), args.cold_mb << 20)
            for name in ("qkv", "gate_up") for m in args.batches.split(",")]
    errors = [{k: v for k, v in r.items() if k.endswith("_error")} for r in rows]
    if any(errors):
        print("errors:", next(e for e in errors if e))
    write_result(args.out, {"model": args.model, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
