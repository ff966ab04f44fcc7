"""Lab probe (issue 20): tiles of the chain's Gluon GEMMs (pdserve/common/ops/gluon_gemm.py) for
large weights. The product's tiles were chosen on the Qwen3-0.6B geometry (2-13 MB weights) and
lose to cuBLAS on the Qwen3-8B / Qwen2.5-7B projections (34-271 MB) beyond 64 rows
(bench/results/gemm_cold/geometry_rows/): with 32-64-column N tiles every program re-reads its
M rows of the activation, (N / bn) x M x K x 2 B from L2 against the weight's N x K x 2 B.

Here each projection alone, weights cycled beyond L2, over candidate tiles with wider N tiles
and more K splits (``CANDIDATES``), against cuBLAS (``F.linear``). QKV is tried both whole
(``linear``) and as split-K partials (the qk-norm/RoPE kernel adds partials up). Every way is
checked against ``F.linear`` first (split-K partials summed for the check only: the times are
of the GEMM alone; the product adds partials up inside the next kernel). The activation has
whole M tiles, as the product gives it.

    python -m bench.gluon_tiles_probe --model qwen3-8b --out bench/results/gemm_cold/gluon_tiles_qwen3-8b.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.cold_weights import time_cold, weight_copies, write_rows
from bench.common import copy_bandwidth
from bench.gemm_shapes import gemm_shapes
from pdserve.common.ops import gluon_gemm
from pdserve.common.ops.gemm_tiles import SMEM_BYTES, Tiles

# (bm, bn, bk, stages, splits); bm is raised to 128 where the rows need two M tiles of 64 or more
CANDIDATES = {
    "qkv": [(64, 32, 128, 4, 1), (64, 64, 128, 3, 1), (64, 128, 64, 4, 1), (64, 128, 128, 3, 1),
            (64, 64, 128, 3, 2), (64, 128, 64, 4, 2), (64, 128, 128, 3, 2), (64, 128, 128, 3, 4)],
    "gate_up": [(64, 32, 128, 3, 1), (64, 32, 64, 4, 1), (64, 64, 64, 4, 1), (64, 64, 128, 3, 1),
                (64, 128, 64, 3, 1)],
    "o_proj": [(64, 32, 128, 3, 4), (64, 64, 128, 3, 4), (64, 128, 64, 4, 4), (64, 128, 128, 3, 4),
               (64, 128, 128, 3, 8), (64, 128, 64, 4, 8), (64, 64, 128, 3, 8)],
}
CANDIDATES["down"] = CANDIDATES["o_proj"]


def _tiles(c: tuple[int, ...], m: int) -> Tiles:
    bm = c[0] if m <= 64 else 128
    t = Tiles(bm, *c[1:4], splits=c[4], overlap=True)
    return t


def _run(op: str, a: torch.Tensor, w: torch.Tensor, t: Tiles) -> torch.Tensor:
    if op == "gate_up":
        return gluon_gemm.silu_linear(a, w, t, pdl=False)
    if t.splits == 1:
        return gluon_gemm.linear(a, w, t, pdl=False)
    return gluon_gemm.splitk(a, w, t, pdl=False)


def row(op: str, n: int, k: int, m: int, bandwidth: float, cold_bytes: int) -> dict:
    ws = weight_copies(n, k, cold_bytes)
    a_pad = torch.randn(-(-m // 128) * 128 if m > 64 else 64, k, device="cuda", dtype=torch.bfloat16)
    a = a_pad[:m].clone()
    ref = F.linear(a, ws[0])
    if op == "gate_up":
        ref = (F.silu(ref[:, :n // 2].float()) * ref[:, n // 2:].float()).to(a.dtype)
    out: dict = {"gemm": op, "M": m, "N": n, "K": k, "floor_us": 1e6 * n * k * 2 / bandwidth,
                 "cublas_us": 1e6 * time_cold(lambda i: F.linear(a, ws[i]), len(ws))}
    for c in CANDIDATES[op]:
        t = _tiles(c, m)
        label = "g" + "x".join(str(v) for v in (t.bm, *c[1:]))
        weight_tiles = 2 if op == "gate_up" else 1
        n_out = n // 2 if op == "gate_up" else n
        if not t.fits(n_out, k) or t.smem_bytes(weight_tiles, 4 if t.splits > 1 else 2) > SMEM_BYTES:
            continue
        rows = -(-m // t.bm) * t.bm
        try:
            got = _run(op, a_pad[:rows], ws[0], t)
            got = got[:, :m].sum(0).to(a.dtype) if got.dim() == 3 else got[:m]
            torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)
            out[f"{label}_us"] = 1e6 * time_cold(lambda i, t=t, r=rows: _run(op, a_pad[:r], ws[i], t), len(ws))
        except Exception as e:                                   # noqa: BLE001 (record, go on)
            out[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    best = min((v, k2[:-3]) for k2, v in out.items() if k2.startswith("g") and k2.endswith("_us"))
    print(f"{op:8s} M={m:4d} floor {out['floor_us']:6.1f} cublas {out['cublas_us']:6.1f} "
          f"best {best[1]} {best[0]:6.1f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batches", default="16,48,64,128,256")
    p.add_argument("--ops", default="qkv,gate_up,o_proj,down")
    p.add_argument("--cold-mb", type=int, default=128)
    p.add_argument("--out", default="bench/results/gemm_cold/gluon_tiles.json")
    args = p.parse_args(argv)
    shapes = gemm_shapes(args.model)
    bandwidth = copy_bandwidth()
    rows = [row(op, *shapes[op], int(m), bandwidth, args.cold_mb << 20)
            for op in args.ops.split(",") for m in args.batches.split(",")]
    write_rows(args.out, args.model, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
