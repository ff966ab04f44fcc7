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
- ``pdl_prefetch``: ``pdl`` plus the GEMM's weight prefetch before its wait;
- ``pdl_preload``: ``pdl`` with the GEMM loading its whole weight slice (32 rows) into registers
  before its wait, in two tiles of K/2.

    python -m bench.pdl_gemm_probe --out bench/results/gemm_cold/pdl_gemm_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from bench.cold_weights import describe, linear, rms_norm_kernel, time_ways, weight_copies, write_rows
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops.fused import rms_norm


def tile(m: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, stages, warps) from bench/gemm_triton_probe.py's best configs."""
    if m <= 16:
        return 16, 32, 128, 4, 4
    if m <= 64:
        return 64, 32, 128, 4, 4
    return 64, 64, 128, 4, 4


def chain(name: str, n: int, k: int, m: int, cold_bytes: int) -> dict:
    ws = weight_copies(n, k, cold_bytes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    cfg = tile(m)

    def triton_pair(i: int, pdl: bool, prefetch: bool = False, preload: bool = False) -> torch.Tensor:
        extra = {"launch_pdl": True} if pdl else {}
        rms_norm_kernel[(m,)](x, g, normed, k, 1e-6, BLOCK=triton.next_power_of_2(k), PDL=pdl, num_warps=4, **extra)
        tile_cfg = (cfg[0], 32, k // 2, 1, 8) if preload else cfg   # the whole slice in two register tiles
        return linear(normed, ws[i], out, tile_cfg, pdl=pdl, prefetch=prefetch, preload=preload)

    ways = {"cublas": lambda i: F.linear(rms_norm(x, g, 1e-6), ws[i]),
            "triton": lambda i: triton_pair(i, False),
            "pdl": lambda i: triton_pair(i, True),
            "pdl_prefetch": lambda i: triton_pair(i, True, prefetch=True),
            "pdl_preload": lambda i: triton_pair(i, True, preload=True)}
    ref = F.linear(rms_norm(x, g, 1e-6), ws[0])
    row = {"gemm": name, "M": m, "N": n, "K": k, "copies": len(ws), "tile": list(cfg),
           **time_ways(ways, ref, len(ws), poison=(normed, out))}
    print(f"{name:8s} M={m:4d}: " + describe(row, list(ways)))
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
    write_rows(args.out, args.model, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
