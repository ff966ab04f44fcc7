"""Lab probe (issue 20): the dense half of a decode layer as a dataflow chain, against the engine's
kernels, with the weights in DRAM as in a real step.

The chain runs from the attention output to the next layer's QKV, six launches a layer:
``o_proj -> add+RMSNorm -> gate_up with SiLU-mul in its epilogue -> down -> add+RMSNorm -> qkv``.
Every kernel is launched with programmatic dependent launch (PDL) and releases the next one at
its start, so a GEMM's programs become resident while the kernels before it still run. Each GEMM
program first loads its whole weight slice (``BN`` rows of every K tile) into registers, which
needs nothing from earlier kernels, then waits (``gdc_wait``) for its input and multiplies it
16 rows at a time. A projection's weight then streams in under the kernels before it instead of
after them. On the Qwen3-0.6B geometry every projection's weight fits in one wave of programs
(64-192 programs of 64-96 KB).

Ways, each timed over 8 layers whose weights (252 MB) overflow the L2, in one CUDA graph:
- ``engine``: ``F.linear`` (cuBLAS) and the engine's fused RMSNorm and SiLU-mul kernels;
- ``dataflow``: the chain above; ``dataflow_nopdl``: the same kernels launched without PDL.

Each way's QKV and residual are checked against a float32 torch reference on fresh random inputs,
outputs poisoned with NaN first.

    python -m bench.dataflow_layer_probe --out bench/results/dataflow/dataflow_layer_probe_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from bench.common import graph_time, write_result
from pdserve.common.ops.fused import rms_norm, silu_and_mul

H, QKV, INTER, QDIM, EPS = 1024, 4096, 3072, 2048, 1e-6
# projection -> (BN, BK, KT, warps); K = BK * KT; programs = N / BN
TILES = {"o": (16, 1024, 2, 8), "gate_up": (16, 512, 2, 8), "down": (16, 1024, 3, 8), "qkv": (32, 512, 2, 8)}
MAX_M = 64                          # the whole batch in one dot (BM = M padded to 16..64)
COMPILED: dict = {}                 # (weight shape, BM, pdl) -> compiled kernel, for its resource report


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``res_out = x + res``; ``out = w * norm(res_out)`` (the engine's numerics), one row a program."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)            # no producer: before the wait
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
    tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _load_tiles(w_ptrs, BK: tl.constexpr, KT: tl.constexpr):
    """Up to four [BN, BK] tiles of a weight slice (unused ones repeat the first)."""
    w0 = tl.load(w_ptrs)
    w1 = w0
    w2 = w0
    w3 = w0
    if KT > 1:
        w1 = tl.load(w_ptrs + BK)
    if KT > 2:
        w2 = tl.load(w_ptrs + 2 * BK)
    if KT > 3:
        w3 = tl.load(w_ptrs + 3 * BK)
    return w0, w1, w2, w3


@triton.jit
def _dot_tiles(a_ptrs, m_mask, w0, w1, w2, w3, BK: tl.constexpr, KT: tl.constexpr, acc):
    acc = tl.dot(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), tl.trans(w0), acc)
    if KT > 1:
        acc = tl.dot(tl.load(a_ptrs + BK, mask=m_mask[:, None], other=0.0), tl.trans(w1), acc)
    if KT > 2:
        acc = tl.dot(tl.load(a_ptrs + 2 * BK, mask=m_mask[:, None], other=0.0), tl.trans(w2), acc)
    if KT > 3:
        acc = tl.dot(tl.load(a_ptrs + 3 * BK, mask=m_mask[:, None], other=0.0), tl.trans(w3), acc)
    return acc


@triton.jit
def _preload_linear_kernel(a_ptr, w_ptr, c_ptr, M, n_out,
                           BN: tl.constexpr, BK: tl.constexpr, KT: tl.constexpr, BM: tl.constexpr,
                           GATED: tl.constexpr, PDL: tl.constexpr):
    """``c[M, n_out] = a[M, K] @ w[n_out, K]^T`` (``M <= BM``) with this program's ``BN`` weight
    rows loaded before the wait; ``GATED``: ``w`` is ``[2 * n_out, K]`` (gate rows, then up rows) and
    ``c = silu(a @ gate^T) * (a @ up^T)``, each product rounded to the dtype first."""
    K = BK * KT
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    g0, g1, g2, g3 = _load_tiles(w_ptrs, BK, KT)
    u0, u1, u2, u3 = g0, g1, g2, g3
    if GATED:
        u0, u1, u2, u3 = _load_tiles(w_ptrs + n_out * K, BK, KT)
    if PDL:
        tl.extra.cuda.gdc_wait()
    offs_m = tl.arange(0, BM)
    m_mask = offs_m < M
    a_ptrs = a_ptr + offs_m[:, None] * K + offs_k[None, :]
    acc = _dot_tiles(a_ptrs, m_mask, g0, g1, g2, g3, BK, KT, tl.zeros([BM, BN], dtype=tl.float32))
    if GATED:
        up = _dot_tiles(a_ptrs, m_mask, u0, u1, u2, u3, BK, KT, tl.zeros([BM, BN], dtype=tl.float32))
        gate = acc.to(c_ptr.dtype.element_ty).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up.to(c_ptr.dtype.element_ty).to(tl.float32)
    tl.store(c_ptr + offs_m[:, None] * n_out + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_mask[:, None])


def _pdl_launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


def preload_linear(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, tile: tuple[int, int, int, int],
                   pdl: bool, gated: bool = False) -> torch.Tensor:
    bn, bk, kt, warps = tile
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    assert a.shape[1] == w.shape[1] == bk * kt and n_out % bn == 0 and a.is_contiguous()
    bm = max(16, triton.next_power_of_2(a.shape[0]))
    assert bm <= MAX_M, a.shape
    k = _preload_linear_kernel[(n_out // bn,)](a, w, out, a.shape[0], n_out, BN=bn, BK=bk, KT=kt, BM=bm,
                                               GATED=gated, PDL=pdl, num_warps=warps, **_pdl_launch(pdl))
    COMPILED[(w.shape, bm, pdl)] = k
    return out


def add_rms_norm(x, res, w, out, res_out, pdl: bool) -> None:
    _add_rms_norm_kernel[(x.shape[0],)](x, res, w, out, res_out, x.shape[1], EPS,
                                        BLOCK=triton.next_power_of_2(x.shape[1]), PDL=pdl, num_warps=4,
                                        **_pdl_launch(pdl))


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


def dataflow_layer(attn, res, lw, bufs, pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    preload_linear(attn, lw["o"], bufs["o"], TILES["o"], pdl)
    add_rms_norm(bufs["o"], res, lw["g1"], bufs["x"], bufs["r1"], pdl)
    preload_linear(bufs["x"], lw["gate_up"], bufs["act"], TILES["gate_up"], pdl, gated=True)
    preload_linear(bufs["act"], lw["down"], bufs["d"], TILES["down"], pdl)
    add_rms_norm(bufs["d"], bufs["r1"], lw["g2"], bufs["x2"], bufs["r2"], pdl)
    return preload_linear(bufs["x2"], lw["qkv"], bufs["qkv"], TILES["qkv"], pdl), bufs["r2"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure(m: int, layers: list[dict]) -> dict:
    attn = torch.randn(m, QDIM, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    shapes = {"o": H, "x": H, "r1": H, "act": INTER, "d": H, "x2": H, "r2": H, "qkv": QKV}
    bufs = {k: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for k, n in shapes.items()}
    ref_qkv, ref_res = reference(attn, res, layers[0])
    row: dict = {"M": m}
    ways = {"engine": (engine_layer, False)}
    if m <= MAX_M:
        ways.update({"dataflow": (dataflow_layer, True), "dataflow_nopdl": (dataflow_layer, False)})
    for name, (layer_fn, pdl) in ways.items():
        try:
            for b in bufs.values():
                b.fill_(float("nan"))
            qkv, r = layer_fn(attn, res, layers[0], bufs, pdl)
            errs = (rel_err(qkv, ref_qkv), rel_err(r, ref_res))
            assert max(errs) < 1e-2, f"{name} M={m}: relative errors {errs}"
            secs = graph_time(lambda fn=layer_fn, p=pdl: [fn(attn, res, lw, bufs, p) for lw in layers], replays=20)
            row[f"{name}_us"] = 1e6 * secs / len(layers)
            row[f"{name}_rel_err"] = max(errs)
        except Exception as e:                                   # noqa: BLE001 (record, go on)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def projection_rows(m: int, layers: list[dict]) -> list[dict]:
    """Each projection alone (plain launches, weights cycled over the layers): cuBLAS (with the
    engine's SiLU-mul after gate_up) against the preloading kernel, and that kernel's resources."""
    rows = []
    for name, (n_out, k) in {"o": (H, QDIM), "gate_up": (INTER, H), "down": (H, INTER), "qkv": (QKV, H)}.items():
        gated = name == "gate_up"
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n_out), float("nan"), device="cuda", dtype=torch.bfloat16)
        full = a.float() @ layers[0][name].float().t()
        ref = F.silu(full[:, :INTER]) * full[:, INTER:] if gated else full
        row: dict = {"M": m, "projection": name, "tile": TILES[name]}
        ways = {"cublas": lambda lw, name=name, a=a, gated=gated: (silu_and_mul(F.linear(a, lw[name])) if gated
                                                                   else F.linear(a, lw[name])),
                "preload": lambda lw, name=name, a=a, out=out, gated=gated: preload_linear(
                    a, lw[name], out, TILES[name], False, gated=gated)}
        for way, fn in ways.items():
            try:
                err = rel_err(fn(layers[0]), ref)
                assert err < 1e-2, f"{way} {name} M={m}: relative error {err}"
                row[f"{way}_us"] = 1e6 * graph_time(lambda fn=fn: [fn(lw) for lw in layers], replays=20) / len(layers)
            except Exception as e:                               # noqa: BLE001 (record, go on)
                row[f"{way}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        ck = COMPILED.get((layers[0][name].shape, max(16, triton.next_power_of_2(m)), False))
        if ck is not None:
            row.update(regs=getattr(ck, "n_regs", None), spills=getattr(ck, "n_spills", None),
                       shared=getattr(getattr(ck, "metadata", None), "shared", None))
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,16,32,64,256")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default="bench/results/dataflow/dataflow_layer_probe.json")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    layers = make_layers(a.layers)
    floor_bytes = sum(layers[0][k].numel() * 2 for k in ("o", "gate_up", "down", "qkv"))
    batches = [int(m) for m in a.batches.split(",")]
    proj = [r for m in batches if m <= MAX_M for r in projection_rows(m, layers)]
    rows = [measure(m, layers) for m in batches]
    write_result(a.out, {"tiles": TILES, "layers": a.layers, "weight_bytes_per_layer": floor_bytes, "rows": rows,
                         "projections": proj})
    for r in proj:
        print(f"  {r['projection']:8s} M={r['M']:3d}: cublas {r.get('cublas_us', float('nan')):6.2f} us, preload "
              f"{r.get('preload_us', float('nan')):6.2f} us (regs {r.get('regs')}, spills {r.get('spills')}, "
              f"smem {r.get('shared')}) {r.get('preload_error', '')[:100]}")
    print(f"weights {floor_bytes / 1e6:.1f} MB a layer; us a layer (dense half: 4 projections, 2 norms, SiLU-mul)")
    for r in rows:
        cells = [f"{w} {r[w + '_us']:6.2f}" if w + "_us" in r else f"{w} ERROR {r.get(w + '_error', '')[:80]}"
                 for w in ("engine", "dataflow", "dataflow_nopdl")]
        print(f"  M={r['M']:4d}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
