"""Lab probe (issue 20): the dense half of a decode layer as a dataflow chain, against the engine's
kernels, with the weights in DRAM as in a real step.

The chain runs from the attention output to the next layer's QKV, seven launches a layer:
``o_proj -> add+RMSNorm -> gate_up -> SiLU-mul -> down -> add+RMSNorm -> qkv``. Every kernel is
launched with programmatic dependent launch (PDL) and releases the next one at its start, so a
GEMM's programs become resident while the kernels before it still run. Each GEMM program first
loads its weight tile (32 rows x 512 columns, 32 KB) into registers, which needs nothing from
earlier kernels, then waits (``gdc_wait``) for its input and multiplies the whole batch at once
(M <= 64). o_proj, gate_up and down are split over K (one tile a program: 128, 384 and 192
programs, all resident at once) and write fp32 partial sums, which the next kernel (the norm, or
SiLU-mul) adds up while it reads them; qkv keeps two tiles a program (128 programs) and writes
bf16. A projection's weight then streams in under the kernels before it instead of after them.

Ways, each timed over 8 layers whose weights (252 MB) overflow the L2, in one CUDA graph:
- ``engine``: ``F.linear`` (cuBLAS) and the engine's fused RMSNorm and SiLU-mul kernels;
- ``dataflow``: the chain above; ``dataflow_nopdl``: the same kernels launched without PDL.

Each way's QKV and residual are checked against a float32 torch reference on fresh random inputs,
outputs poisoned with NaN first; the compiler's register, spill and shared-memory report of each
chain kernel is recorded.

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
BN, BK = 32, 512                    # a weight tile: 32 rows x 512 columns (32 KB of bf16)
CHUNK = 16                          # rows a dot takes at once; a larger batch loops
MAX_M = 256
COMPILED: dict = {}                 # kernel name -> compiled kernel, for its resource report


def _pdl_launch(pdl: bool) -> dict:
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def _splitk_kernel(a_ptr, w_ptr, part_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   PDL: tl.constexpr):
    """``part[ks, :M, n-tile] = a[:M, k-tile] @ w[n-tile, k-tile]^T`` (fp32); grid (N / BN, K / BK).
    The weight tile is loaded before the wait, then the batch is taken ``BM`` rows at a time."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    ks = tl.program_id(1)
    offs_k = ks * BK + tl.arange(0, BK)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :])
    if PDL:
        tl.extra.cuda.gdc_wait()
    for m0 in range(0, M, BM):
        offs_m = m0 + tl.arange(0, BM)
        m_mask = offs_m < M
        a = tl.load(a_ptr + offs_m[:, None] * K + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        acc = tl.dot(a, tl.trans(w))
        tl.store(part_ptr + (ks * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=m_mask[:, None])


@triton.jit
def _preload_linear_kernel(a_ptr, w_ptr, c_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           PDL: tl.constexpr):
    """``c[:M, n-tile] = a[:M] @ w[n-tile]^T`` for ``K = 2 * BK``, both weight tiles loaded before
    the wait, then the batch ``BM`` rows at a time; grid (N / BN,)."""
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * (2 * BK) + offs_k[None, :]
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    w0 = tl.load(w_ptrs)
    w1 = tl.load(w_ptrs + BK)
    if PDL:
        tl.extra.cuda.gdc_wait()
    for m0 in range(0, M, BM):
        offs_m = m0 + tl.arange(0, BM)
        m_mask = offs_m < M
        a_ptrs = a_ptr + offs_m[:, None] * (2 * BK) + offs_k[None, :]
        acc = tl.dot(tl.load(a_ptrs, mask=m_mask[:, None], other=0.0), tl.trans(w0))
        acc = tl.dot(tl.load(a_ptrs + BK, mask=m_mask[:, None], other=0.0), tl.trans(w1), acc)
        tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=m_mask[:, None])


@triton.jit
def _add_norm_partials_kernel(part_ptr, KS, res_ptr, w_ptr, out_ptr, res_out_ptr, M, n_cols, eps,
                              BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``x = round(sum_ks part[ks, row]) + res[row]`` (the projection's dtype output, then the
    residual add, as the engine rounds); ``res_out = x``; ``out = w * norm(x)``. One row a program."""
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
        acc += tl.load(part_ptr + (ks * M + row) * n_cols + cols, mask=mask, other=0.0)
    res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
    x = acc.to(res.dtype) + res
    tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)).to(x.dtype)
    tl.store(out_ptr + row * n_cols + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def _silu_partials_kernel(part_ptr, KS, out_ptr, M, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out[row] = silu(gate) * up`` from the partial sums of ``[gate | up]`` (each rounded to
    the dtype first, as the engine's gate_up output is); grid (M, inter / BLOCK)."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for ks in range(KS):
        base = part_ptr + (ks * M + row) * (2 * inter)
        gate += tl.load(base + cols)
        up += tl.load(base + inter + cols)
    dt = out_ptr.dtype.element_ty
    gate = gate.to(dt).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up.to(dt).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, y.to(dt))


def _bm(m: int) -> int:
    """Rows a dot takes: the whole batch padded to 16, or ``CHUNK`` at a time beyond ``CHUNK``."""
    return min(max(16, triton.next_power_of_2(m)), CHUNK)


def splitk(a: torch.Tensor, w: torch.Tensor, part: torch.Tensor, pdl: bool, name: str) -> torch.Tensor:
    """fp32 partials ``[K / BK, M, N]`` of ``a @ w^T`` (a view of ``part``)."""
    (m, k), n = a.shape, w.shape[0]
    assert k % BK == 0 and n % BN == 0 and a.is_contiguous()
    out = part[:k // BK * m * n].view(k // BK, m, n)
    COMPILED[name] = _splitk_kernel[(n // BN, k // BK)](a, w, out, m, n, k, BM=_bm(m), BN=BN, BK=BK, PDL=pdl,
                                                         num_warps=4, **_pdl_launch(pdl))
    return out


def preload_linear(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, pdl: bool) -> torch.Tensor:
    (m, k), n = a.shape, w.shape[0]
    assert k == 2 * BK and n % BN == 0 and a.is_contiguous()
    COMPILED["qkv"] = _preload_linear_kernel[(n // BN,)](a, w, out, m, n, BM=_bm(m), BN=BN, BK=BK, PDL=pdl,
                                                         num_warps=8, **_pdl_launch(pdl))
    return out


def add_norm_partials(part, res, w, out, res_out, pdl: bool, name: str) -> None:
    ks, m, n = part.shape
    COMPILED[name] = _add_norm_partials_kernel[(m,)](part, ks, res, w, out, res_out, m, n, EPS,
                                                     BLOCK=triton.next_power_of_2(n), PDL=pdl, num_warps=4,
                                                     **_pdl_launch(pdl))


def silu_partials(part: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
    ks, m, two_i = part.shape
    block = 1024
    COMPILED["silu"] = _silu_partials_kernel[(m, two_i // 2 // block)](part, ks, out, m, two_i // 2, BLOCK=block,
                                                                      PDL=pdl, num_warps=4, **_pdl_launch(pdl))


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
    add_norm_partials(splitk(attn, lw["o"], bufs["part"], pdl, "o"), res, lw["g1"], bufs["x"], bufs["r1"], pdl,
                      "norm1")
    silu_partials(splitk(bufs["x"], lw["gate_up"], bufs["part"], pdl, "gate_up"), bufs["act"], pdl)
    add_norm_partials(splitk(bufs["act"], lw["down"], bufs["part"], pdl, "down"), bufs["r1"], lw["g2"], bufs["x2"],
                      bufs["r2"], pdl, "norm2")
    return preload_linear(bufs["x2"], lw["qkv"], bufs["qkv"], pdl), bufs["r2"]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure(m: int, layers: list[dict]) -> dict:
    attn = torch.randn(m, QDIM, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, H, device="cuda", dtype=torch.bfloat16)
    shapes = {"o": H, "x": H, "r1": H, "act": INTER, "d": H, "x2": H, "r2": H, "qkv": QKV}
    bufs = {k: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for k, n in shapes.items()}
    bufs["part"] = torch.empty(2 * m * 2 * INTER, device="cuda", dtype=torch.float32)  # the largest: gate_up's
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
            if name == "dataflow":
                row["resources"] = {k: {"regs": getattr(ck, "n_regs", None), "spills": getattr(ck, "n_spills", None),
                                        "smem": getattr(getattr(ck, "metadata", None), "shared", None)}
                                    for k, ck in COMPILED.items()}
        except Exception as e:                                   # noqa: BLE001 (record, go on)
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,16,32,64,128,256")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--chunks", default="16,32", help="rows a dot takes at once (each a set of rows)")
    p.add_argument("--out", default="bench/results/dataflow/dataflow_layer_probe.json")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    layers = make_layers(a.layers)
    floor_bytes = sum(layers[0][k].numel() * 2 for k in ("o", "gate_up", "down", "qkv"))
    batches = [int(m) for m in a.batches.split(",")]
    global CHUNK
    rows = []
    for CHUNK in (int(c) for c in a.chunks.split(",")):
        rows += [{"chunk": CHUNK, **measure(m, layers)} for m in batches]
    write_result(a.out, {"tile": [BN, BK], "layers": a.layers, "weight_bytes_per_layer": floor_bytes, "rows": rows})
    print(f"weights {floor_bytes / 1e6:.1f} MB a layer; us a layer (dense half: 4 projections, 2 norms, SiLU-mul)")
    for r in rows:
        cells = [f"{w} {r[w + '_us']:6.2f}" if w + "_us" in r else f"{w} ERROR {r.get(w + '_error', '')[:80]}"
                 for w in ("engine", "dataflow", "dataflow_nopdl")]
        print(f"  chunk {r['chunk']:3d} M={r['M']:4d}: " + ", ".join(cells))
        if "resources" in r:
            print("          " + "; ".join(f"{k} {v['regs']} regs {v['spills']} spills {v['smem']} smem"
                                       for k, v in r["resources"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
