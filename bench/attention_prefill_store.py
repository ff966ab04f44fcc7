"""Prefill and KV-store parts of bench/attention_kernels.py: the Triton prefill kernel on a few
shapes (TFLOP/s with causal FLOPs; torch SDPA on contiguous tensors as a baseline where it
applies, checked against the torch reference) and the KV store (graph-timed)."""
from __future__ import annotations

import torch

from bench.attention_common import DEV, DTYPE, HKV, HQ, D, bench_ms, block_tables_for, rel_err
from pdserve.common.ops import kv_store, paged_attention_prefill
from pdserve.common.ops.reference import paged_attention_prefill_ref

# prefill (name, q_lens, context_lens); None: 16 ragged fresh prompts of 100..1024 tokens
PREFILL_SHAPES = [
    ("1x2048 fresh", [2048], [2048]),
    ("8x512 fresh", [512] * 8, [512] * 8),
    ("4x256 new + 1024 prefix", [256] * 4, [1280] * 4),
    ("16 ragged 100-1024 fresh", None, None),
    ("64x16 chunks + 1000 prefix", [16] * 64, [1016] * 64),
]


def _prefill_row(name: str, q_lens: list[int], ctx: list[int], bs: int, layers: int,
                 gen: torch.Generator) -> dict:
    """Time and check the prefill kernel on one shape; the shape's tensors are freed on return."""
    num_blocks = sum(-(-c // bs) for c in ctx) + 16
    kv = torch.randn(num_blocks, layers, 2, bs, HKV, D, device=DEV, dtype=DTYPE)
    kc, vc = kv[:, 1, 0], kv[:, 1, 1]
    bt = block_tables_for(len(ctx), ctx, bs, num_blocks, gen)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    T = sum(q_lens)
    q = torch.randn(T, HQ, D, device=DEV, dtype=DTYPE)
    out = torch.empty_like(q)

    def fn() -> None:
        paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, max(q_lens), D ** -0.5, out=out)

    fn()
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, max(q_lens), D ** -0.5)
    t = bench_ms(fn)
    pairs = sum(sum(c - n + i + 1 for i in range(n)) for n, c in zip(q_lens, ctx))
    flops = 4 * D * HQ * pairs
    row = {"shape": name, "tokens": T, "ms": t, "tflops": flops / (t * 1e-3) / 1e12,
           "rel_err": rel_err(out, ref)}
    if len(set(q_lens)) == 1 and q_lens == ctx:      # SDPA baseline on contiguous tensors
        ts = _sdpa_ms(len(q_lens), q_lens[0])
        row["sdpa_ms"] = ts
        row["sdpa_tflops"] = flops / (ts * 1e-3) / 1e12
    return row


def _sdpa_ms(B: int, S: int) -> float:
    """Median ms of causal torch SDPA on contiguous [B, heads, S, D] tensors (GQA expanded)."""
    qs = torch.randn(B, HQ, S, D, device=DEV, dtype=DTYPE)
    ks = torch.randn(B, HKV, S, D, device=DEV, dtype=DTYPE).repeat_interleave(HQ // HKV, 1)
    vs = torch.randn_like(ks)
    return bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))


def prefill_benchmarks(args) -> list[dict]:
    gen = torch.Generator().manual_seed(args.seed + 1)
    rows = []
    for name, q_lens, ctx in PREFILL_SHAPES:
        if q_lens is None:
            q_lens = torch.randint(100, 1025, (16,), generator=gen).tolist()
            ctx = list(q_lens)
        rows.append(_prefill_row(name, q_lens, ctx, args.block_size, args.layers, gen))
    torch.cuda.empty_cache()
    return rows


def _store_row(kv: torch.Tensor, n: int) -> dict:
    """Time storing ``n`` tokens' K and V into layer 1 of ``kv`` at random slots."""
    num_slots = kv.shape[0] * kv.shape[3]
    key = torch.randn(n, HKV, D, device=DEV, dtype=DTYPE)
    value = torch.randn(n, HKV, D, device=DEV, dtype=DTYPE)
    slots = torch.randperm(num_slots, device=DEV)[:n].to(torch.int32)

    def fn() -> None:
        kv_store.store_kvcache(key, value, kv[:, 1, 0], kv[:, 1, 1], slots)

    fn()
    t = bench_ms(fn, graph=True)
    byt = 2 * 2 * n * HKV * D * 2               # read + write, K and V
    return {"tokens": n, "us_cudagraph": t * 1e3, "gbps_rw": byt / (t * 1e-3) / 1e9}


def store_benchmarks(args) -> list[dict]:
    bs, layers = args.block_size, args.layers
    num_blocks = 2048
    kv = torch.zeros(num_blocks, layers, 2, bs, HKV, D, device=DEV, dtype=DTYPE)
    rows = [_store_row(kv, n) for n in (256, 8192)]
    del kv
    torch.cuda.empty_cache()
    return rows


def print_prefill(rows: list[dict]) -> None:
    print("\nprefill (bf16, causal; TFLOP/s counts visible pairs only)")
    print(f"  {'shape':30s} {'tokens':>6s} {'ms':>8s} {'TFLOP/s':>8s} {'rel_err':>9s}"
          f" {'sdpa ms':>8s} {'sdpa TF/s':>9s}")
    for r in rows:
        print(f"  {r['shape']:30s} {r['tokens']:6d} {r['ms']:8.3f} {r['tflops']:8.1f} {r['rel_err']:9.2e}"
              + (f" {r['sdpa_ms']:8.3f} {r['sdpa_tflops']:9.1f}" if "sdpa_ms" in r else ""))


def print_store(rows: list[dict]) -> None:
    print("\nstore_kvcache")
    for r in rows:
        print(f"  {r['tokens']:6d} tokens  {r['us_cudagraph']:8.1f} us  {r['gbps_rw']:6.0f} GB/s (r+w)")
