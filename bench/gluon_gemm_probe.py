"""Lab probe (issue 20): the Gluon GEMM of the decode chain's wide range
(pdserve/common/ops/gluon_gemm.py), which fetches its weight tiles into shared memory by TMA
*before* it waits (programmatic dependent launch) for the kernel that writes its input, against
cuBLAS, one (norm, projection) pair at a time, at any tiles.

Triton's ``tl`` cannot issue a load into shared memory ahead of ``gdc_wait`` (bench/NOTES.md runs
29-30, 33: its loads before the wait land in registers, and whole weight slices do not fit
there beyond 16 rows). This probe first had a kernel of its own (run 45, up to f7c695c: the one
the product's grew from); it now times the product's kernel at the tiles given on the command
line (4 warps, the grid's N tiles fastest as in run 45).

Timed as (RMSNorm, GEMM) pairs over weights cycled beyond L2, as bench/pdl_gemm_probe.py does,
every way checked against ``F.linear`` of the engine's RMSNorm on fresh random inputs first:

- ``cublas``: engine RMSNorm -> ``F.linear`` (the engine's usual path);
- ``gluon``: the probe norm -> the Gluon GEMM, plain launches;
- ``gluon_pdl``: both with PDL, the GEMM's first weight tiles in flight before its wait.

o_proj and down are split over K, their fp32 partials added up by ``add_norm_partials``.

    python -m bench.gluon_gemm_probe --out bench/results/gemm_cold/gluon_gemm_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton

from bench.cold_weights import describe, rms_norm_kernel, time_ways, weight_copies, write_rows
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops import gluon_gemm
from pdserve.common.ops.dataflow import add_norm_partials
from pdserve.common.ops.fused import rms_norm
from pdserve.common.ops.gemm_tiles import Tiles


def _tiles(cfg: tuple[int, ...], m: int, splits: int = 1) -> Tiles:
    """cfg: (BM, BN, BK, STAGES[, OVERLAP]); BM 0 = 64 up to 64 rows, else 128."""
    return Tiles(cfg[0] or (64 if m <= 64 else 128), cfg[1], cfg[2], cfg[3], splits=splits,
                 overlap=bool(cfg[4]) if len(cfg) > 4 else False, m_fast=False)


def _norm(x: torch.Tensor, g: torch.Tensor, out: torch.Tensor, pdl: bool) -> torch.Tensor:
    m, k = x.shape
    rms_norm_kernel[(m,)](x, g, out, k, 1e-6, BLOCK=triton.next_power_of_2(k), PDL=pdl, num_warps=4,
                          **({"launch_pdl": True} if pdl else {}))
    return out


def _row(name: str, m: int, n: int, k: int, tiles: Tiles, copies: int, timed: dict) -> dict:
    row = {"gemm": name, "M": m, "N": n, "K": k, "BM": tiles.bm, "BN": tiles.bn, "BK": tiles.bk,
           "stages": tiles.stages, "overlap": tiles.overlap, "splits": tiles.splits, "copies": copies, **timed}
    print(f"{name:8s} M={m:4d} {tiles}: " + describe(row, [w[:-3] for w in timed if w.endswith("_us")]))
    return row


def pair(name: str, n: int, k: int, m: int, cfg: tuple[int, ...], cold_bytes: int) -> dict:
    """qkv / gate_up: norm -> GEMM (``gluon_gemm.linear``), against norm -> ``F.linear``."""
    ws = weight_copies(n, k, cold_bytes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    tiles = _tiles(cfg, m)
    ways = {"cublas": lambda i: F.linear(rms_norm(x, g, 1e-6), ws[i]),
            "gluon": lambda i: gluon_gemm.linear(_norm(x, g, normed, False), ws[i], tiles, pdl=False),
            "gluon_pdl": lambda i: gluon_gemm.linear(_norm(x, g, normed, True), ws[i], tiles, pdl=True)}
    ref = F.linear(rms_norm(x, g, 1e-6), ws[0])
    return _row(name, m, n, k, tiles, len(ws), time_ways(ways, ref, len(ws), poison=(normed,)))


def split_pair(name: str, n: int, k: int, m: int, cfg: tuple[int, ...], splits: int, cold_bytes: int) -> dict:
    """o_proj / down (N = hidden): norm -> GEMM split over K (fp32 partials) -> add + RMSNorm adding
    them up (the product's ``add_norm_partials``), against norm -> ``F.linear`` -> add + RMSNorm."""
    ws = weight_copies(n, k, cold_bytes)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    g2 = 1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    normed = torch.empty_like(x)
    tiles = _tiles(cfg, m, splits)

    def gluon_chain(i: int) -> torch.Tensor:
        part = gluon_gemm.splitk(_norm(x, g, normed, True), ws[i], tiles, pdl=True)
        return add_norm_partials(part, res, g2, 1e-6)[0]

    ways = {"cublas": lambda i: rms_norm(F.linear(rms_norm(x, g, 1e-6), ws[i]), g2, 1e-6, res)[0],
            "gluon_pdl": gluon_chain}
    ref = ways["cublas"](0).clone()
    return _row(name, m, n, k, tiles, len(ws), time_ways(ways, ref, len(ws), poison=(normed,)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--configs", default="0:32:128:4:1,0:64:64:4:1,0:32:256:2:0",
                   help="BM:BN:BK:STAGES[:OVERLAP], comma-separated (BM 0: 64 up to 64 rows, else 128)")
    p.add_argument("--split-configs", default="0:32:128:3:0:2,0:32:128:3:1:4",
                   help="BM:BN:BK:STAGES:OVERLAP:SPLITS for o_proj and down (norm -> GEMM -> add+norm)")
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
