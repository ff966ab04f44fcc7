"""Lab probe (issue 20): why the chain's Gluon GEMMs (pdserve/common/ops/gluon_gemm.py) are slow
at 160-192 rows (bench/NOTES.md run 47's layer sweep: the dense half 46 / 42 us against 36 at 256
rows with the same tiles). Each projection of the Qwen3-0.6B geometry alone, weights cycled beyond
L2, at rows 64-256 with the product's tiles, three ways:

- ``plain``: as the product launched it at 5f30600's parent (N tiles fastest in the grid; the
  activation's last M tile partly past its end, TMA zero-filling those rows);
- ``m_fast``: the grid's M tiles fastest, so the programs that read one weight tile start together;
- ``padded``: the activation and output given whole M tiles (rows past M are garbage, unread).

Each way checked against ``F.linear`` first.

    python -m bench.gluon_rows_probe --out bench/results/gemm_cold/gluon_rows_probe_h100.json
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.nn.functional as F

from bench.cold_weights import describe, time_ways, weight_copies, write_rows
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops import gluon_gemm
from pdserve.common.ops.gemm_tiles import wide_tiles


def _call(op: str, a: torch.Tensor, w: torch.Tensor, m: int, m_fast: bool) -> torch.Tensor:
    tiles = dataclasses.replace(wide_tiles(op, m), m_fast=m_fast)
    if op == "qkv":
        return gluon_gemm.linear(a, w, tiles)
    if op == "gate_up":
        return gluon_gemm.silu_linear(a, w, tiles)
    return gluon_gemm.splitk(a, w, tiles)[:, :m].sum(0)


def row(op: str, n: int, k: int, m: int, cold_bytes: int) -> dict:
    ws = weight_copies(n, k, cold_bytes)
    bm = wide_tiles(op, m).bm
    rows = -(-m // bm) * bm
    a_pad = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    a = a_pad[:m].clone()
    if op == "gate_up":
        gu = F.linear(a, ws[0])
        ref = (F.silu(gu[:, :n // 2].float()) * gu[:, n // 2:].float()).to(a.dtype)
    else:
        ref = F.linear(a, ws[0])
    ref = ref.float() if op in ("o_proj", "down") else ref

    def way(i: int, m_fast: bool = False, padded: bool = False) -> torch.Tensor:
        return _call(op, a_pad if padded else a, ws[i], m, m_fast)[:m]
    ways = {"plain": way, "m_fast": lambda i: way(i, m_fast=True), "padded": lambda i: way(i, padded=True),
            "cublas": lambda i: F.linear(a, ws[i])}
    out = {"gemm": op, "M": m, "N": n, "K": k, "tiles": str(wide_tiles(op, m)), "copies": len(ws)}
    out.update(time_ways({k2: v for k2, v in ways.items() if k2 != "cublas"}, ref, len(ws)))
    out.update(time_ways({"cublas": ways["cublas"]}, F.linear(a, ws[0]), len(ws)))
    print(f"{op:8s} M={m:4d}: " + describe(out, ["plain", "m_fast", "padded", "cublas"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--batches", default="64,96,128,160,192,224,256")
    p.add_argument("--cold-mb", type=int, default=128)
    p.add_argument("--out", default="bench/results/gemm_cold/gluon_rows_probe.json")
    args = p.parse_args(argv)
    shapes = gemm_shapes(args.model)
    rows = [row(op, *shapes[op], int(m), args.cold_mb << 20)
            for op in ("qkv", "gate_up", "o_proj", "down") for m in args.batches.split(",")]
    write_rows(args.out, args.model, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
