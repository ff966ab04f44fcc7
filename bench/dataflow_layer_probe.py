"""Lab probe (issue 20): the dense half of a decode layer as the small-batch chain of
pdserve/common/ops/dataflow.py, against the engine's usual kernels, with the weights in DRAM as in
a real step.

The chain runs from the attention output to the next layer's QKV, seven launches a layer:
``o_proj -> add+RMSNorm -> gate_up -> SiLU-mul -> down -> add+RMSNorm -> qkv``, each launched with
programmatic dependent launch (PDL) on Hopper, each GEMM program loading its 32 x 512 weight tile
before it waits for its input (the module docstring has the rules).

Ways, each timed over 8 layers whose weights (252 MB) overflow the L2, in one CUDA graph:
- ``engine``: ``F.linear`` (cuBLAS) and the engine's fused RMSNorm and SiLU-mul kernels;
- ``dataflow``: the chain (beyond 16 rows QKV left as its split-K partials, which the product's
  qk-norm/RoPE kernel adds up); ``dataflow_nopdl``: the same kernels launched without PDL. Both run up to 64
  rows, past the product's ``dataflow.MAX_ROWS``, to show where the chain stops paying;
- ``wide``: the chain's Gluon range (pdserve/common/ops/gluon_gemm.py, Hopper), 33-256 rows, with
  the product's tiles (``gemm_tiles.wide_tiles``); with ``--sweep``, also each projection's tiles
  replaced by each of ``SWEEP``'s candidates in turn (one projection at a time, the others as the product's).

Each way's QKV and residual are checked against a float32 torch reference on fresh random inputs,
outputs poisoned with NaN first. (Versions of this probe at 3d8e689 and dbd67ae also tried the
batch in chunks of 16 or 32 rows a dot, up to M = 256: bench/NOTES.md run 33; at a5f64ec a "wide"
way split QKV over K when the product still computed it whole: run 38.)

    python -m bench.dataflow_layer_probe --out bench/results/dataflow/dataflow_layer_probe_h100.json
"""
from __future__ import annotations

import argparse
import dataclasses
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from bench.common import graph_time, write_result
from pdserve.common.models.dataflow_decode import qkv_preloads
from pdserve.common.ops import dataflow
from pdserve.common.ops.fused import rms_norm, silu_and_mul
from pdserve.common.ops.gemm_tiles import WIDE_ROWS, Tiles, padded_rows, wide_tiles

H, QKV, INTER, QDIM, EPS = 1024, 4096, 3072, 2048, 1e-6


def make_layers(n: int, device: str = "cuda") -> list[dict]:
    def w(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) / cols ** 0.5
    return [{"o": w(H, QDIM), "gate_up": w(2 * INTER, H), "down": w(H, INTER), "qkv": w(QKV, H),
             "g1": 1 + 0.1 * torch.randn(H, device=device, dtype=torch.bfloat16),
             "g2": 1 + 0.1 * torch.randn(H, device=device, dtype=torch.bfloat16)} for _ in range(n)]


def reference(attn: torch.Tensor, res: torch.Tensor, lw: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 torch: (qkv, residual after the MLP)."""
    def norm(x, g):
        return g.float() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
    h = attn.float() @ lw["o"].float().t() + res.float()
    gu = norm(h, lw["g1"]) @ lw["gate_up"].float().t()
    h2 = (F.silu(gu[:, :INTER]) * gu[:, INTER:]) @ lw["down"].float().t() + h
    return norm(h2, lw["g2"]) @ lw["qkv"].float().t(), h2


def engine_layer(attn, res, lw, bufs, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    del bufs, pdl
    x, r = rms_norm(F.linear(attn, lw["o"]), lw["g1"], EPS, residual=res)
    x, r = rms_norm(F.linear(silu_and_mul(F.linear(x, lw["gate_up"])), lw["down"]), lw["g2"], EPS, residual=r)
    return F.linear(x, lw["qkv"]), r


@contextmanager
def _pdl(on: bool):
    """The chain's kernels with PDL where the GPU has it (``on``), or plain launches."""
    saved = dataflow.pdl_available
    if not on:
        dataflow.pdl_available = lambda device: False
    try:
        yield
    finally:
        dataflow.pdl_available = saved


@contextmanager
def _rows(n: int):
    """The chain's kernels taking up to ``n`` rows in one dot (a lab question: the product stops
    at ``dataflow.MAX_ROWS``)."""
    saved = dataflow.MAX_ROWS
    dataflow.MAX_ROWS = n
    try:
        yield
    finally:
        dataflow.MAX_ROWS = saved


def dataflow_layer(attn, res, lw, bufs, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain's dense half; QKV as the product computes it (``qkv_preloads``), beyond 16 rows
    as its split-K partials [2, M, 4096]."""
    del bufs
    qkv_proj = dataflow.preload_linear if qkv_preloads(attn.shape[0], H) else dataflow.splitk
    with _pdl(pdl), _rows(64):
        x, r = dataflow.add_norm_partials(dataflow.splitk(attn, lw["o"]), res, lw["g1"], EPS)
        act = dataflow.silu_partials(dataflow.splitk(x, lw["gate_up"]), x.dtype)
        x, r = dataflow.add_norm_partials(dataflow.splitk(act, lw["down"]), r, lw["g2"], EPS)
        return qkv_proj(x, lw["qkv"]), r


WIDE_OPS = ("o_proj", "gate_up", "down", "qkv")
# (bm, bn, bk, stages, splits, overlap) candidates a projection's tiles are swept over
SWEEP = {
    "qkv": [(64, 32, 128, 4, 1, 1), (128, 32, 128, 4, 1, 1), (128, 64, 64, 4, 1, 1), (64, 64, 64, 4, 1, 1),
            (64, 64, 128, 3, 1, 1), (128, 64, 128, 3, 1, 1), (128, 128, 64, 3, 1, 1)],
    "gate_up": [(64, 32, 128, 3, 1, 1), (128, 32, 64, 4, 1, 1), (64, 32, 64, 4, 1, 1), (128, 32, 128, 3, 1, 1),
                (64, 64, 64, 3, 1, 1), (128, 64, 64, 3, 1, 1)],
    "o_proj": [(64, 32, 128, 3, 4, 1), (128, 32, 128, 3, 4, 1), (128, 32, 128, 3, 2, 0), (64, 32, 128, 3, 2, 0),
               (64, 32, 64, 4, 4, 1), (128, 64, 64, 4, 4, 1), (64, 64, 128, 3, 4, 1), (128, 32, 64, 4, 8, 1)],
}
SWEEP["down"] = SWEEP["o_proj"]
_TILES: dict[str, Tiles] = {}


def wide_layer(attn, res, lw, bufs, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The Gluon range's dense half with the tiles in ``_TILES``, QKV written whole; the
    activations of ``padded_rows`` rows as in the product (``bufs``: the attention output so padded)."""
    from pdserve.common.ops import gluon_gemm
    del attn, pdl
    t, m, rows = _TILES, res.shape[0], bufs.shape[0]
    x, r = dataflow.add_norm_partials(gluon_gemm.splitk(bufs, lw["o"], t["o_proj"]), res, lw["g1"], EPS, rows)
    act = gluon_gemm.silu_linear(x, lw["gate_up"], t["gate_up"])
    x, r = dataflow.add_norm_partials(gluon_gemm.splitk(act, lw["down"], t["down"]), r, lw["g2"], EPS, rows)
    return gluon_gemm.linear(x, lw["qkv"], t["qkv"])[:m], r


def wide_variants(m: int, sweep: bool, base_bm: int = 0) -> dict[str, dict[str, Tiles]]:
    """'wide' (the product's tiles) and, with ``sweep``, one variant per (projection, candidate)
    around the product's tiles, or around them with every ``bm`` set to ``base_bm`` ('wide_bm<N>')."""
    product = {op: wide_tiles(op, m) for op in WIDE_OPS}
    out = {"wide": product}
    base = product
    if base_bm:
        base = {op: dataclasses.replace(t, bm=base_bm) for op, t in product.items()}
        out[f"wide_bm{base_bm}"] = base
    if sweep:
        for op, cands in SWEEP.items():
            for c in cands:
                tiles = Tiles(*c[:5], overlap=bool(c[5]))
                if tiles != base[op]:
                    out["wide_" + op + "_" + "_".join(str(v) for v in c)] = {**base, op: tiles}
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@contextmanager
def _nan_outputs():
    """New tensors start NaN-filled (``torch.empty`` / ``empty_like`` poisoned while the check
    runs), so an output a kernel leaves unwritten cannot pass."""
    saved = torch.empty, torch.empty_like

    def poison(make):
        def poisoned(*args, **kwargs):
            t = make(*args, **kwargs)
            return t.fill_(float("nan")) if t.is_floating_point() else t
        return poisoned
    torch.empty, torch.empty_like = poison(saved[0]), poison(saved[1])
    try:
        yield
    finally:
        torch.empty, torch.empty_like = saved


def measure(m: int, layers: list[dict], sweep: bool = False, base_bm: int = 0, n_fast: bool = False) -> dict:
    attn = torch.randn(m, QDIM, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    ref_qkv, ref_res = reference(attn, res, layers[0])
    row: dict = {"M": m}
    ways = {"engine": (engine_layer, False)}
    if m <= 64:
        ways.update({"dataflow": (dataflow_layer, True), "dataflow_nopdl": (dataflow_layer, False)})
    variants: dict[str, dict[str, Tiles]] = {}
    if 32 < m <= WIDE_ROWS and torch.cuda.get_device_capability()[0] == 9:
        variants = {name: {op: dataclasses.replace(t, m_fast=not n_fast) for op, t in tiles.items()}
                    for name, tiles in wide_variants(m, sweep, base_bm).items()}
        ways.update({name: (wide_layer, True) for name in variants})
    for name, (layer_fn, pdl) in ways.items():
        bufs = None                               # every way allocates its outputs (NaN-filled below)
        try:
            if name in variants:
                bufs = torch.zeros(padded_rows(m), QDIM, device="cuda", dtype=torch.bfloat16)
                bufs[:m] = attn
                _TILES.clear()
                _TILES.update(variants[name])
            with _nan_outputs():
                qkv, r = layer_fn(attn, res, layers[0], bufs, pdl)
            qkv = qkv.sum(0) if qkv.dim() == 3 else qkv           # the chain's QKV partials
            errs = (rel_err(qkv, ref_qkv), rel_err(r, ref_res))
            assert max(errs) < 1e-2, f"{name} M={m}: relative errors {errs}"
            secs = graph_time(lambda fn=layer_fn, p=pdl, b=bufs: [fn(attn, res, lw, b, p) for lw in layers], replays=20)
            row[f"{name}_us"] = 1e6 * secs / len(layers)
            row[f"{name}_rel_err"] = max(errs)
        except Exception as e:                                   # noqa: BLE001 (record, go on)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,16,24,32,48,64")
    p.add_argument("--sweep", action="store_true", help="also each projection's tile candidates (SWEEP)")
    p.add_argument("--base-bm", type=int, default=0, help="sweep around the product's tiles with this bm")
    p.add_argument("--n-fast", action="store_true", help="the Gluon grids with N tiles fastest (Tiles.m_fast off)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default="bench/results/dataflow/dataflow_layer_probe.json")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    layers = make_layers(a.layers)
    floor_bytes = sum(layers[0][k].numel() * 2 for k in ("o", "gate_up", "down", "qkv"))
    batches = [int(m) for m in a.batches.split(",")]
    rows = [measure(m, layers, a.sweep, a.base_bm, a.n_fast) for m in batches]
    write_result(a.out, {"tile": [dataflow.BN, dataflow.BK], "layers": a.layers, "weight_bytes_per_layer": floor_bytes,
                         "rows": rows})
    print(f"weights {floor_bytes / 1e6:.1f} MB a layer; us a layer (dense half: 4 projections, 2 norms, SiLU-mul)")
    for r in rows:
        cells = [f"{w} {r[w + '_us']:6.2f}" if w + "_us" in r
                 else f"{w} ERROR {r[w + '_error'][:80]}" if w + "_error" in r
                 else f"{w} n/a" for w in ("engine", "dataflow", "dataflow_nopdl", "wide")]
        print(f"  M={r['M']:4d}: " + ", ".join(cells))
        swept = sorted((v, k[:-3]) for k, v in r.items() if k.startswith("wide_") and k.endswith("_us"))
        for v, k in swept[:8]:
            print(f"      {k:40s} {v:6.2f}")
        errors = [k for k in r if k.startswith("wide") and k.endswith("_error")]
        if errors:
            print(f"      {len(errors)} variants failed, e.g. {r[errors[0]][:200]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
