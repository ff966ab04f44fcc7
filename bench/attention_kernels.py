"""Benchmark + correctness check of the Triton paged-attention kernels (pdserve/common/ops) on one GPU.

    python bench/attention_kernels.py --out bench/results/attention_kernels.json [--no-sweep]

1. correctness vs the torch references on fresh random bf16 inputs (decode, prefill with cached
   prefixes, KV store);
2. decode timing at batch 256, context 600, Qwen3-0.6B geometry (16 q heads, 8 kv heads,
   head_dim 128), block size 16, on a KV cache laid out as in docs/design.md
   (``kv_cache[num_blocks, 28 layers, 2, 16, 8, 128]``, one layer's kernel timed), reported as
   K/V bytes read / time and compared with a measured device-to-device copy (1 GiB tensor,
   read + write counted); a small sweep of (BLOCK_N, num_warps, num_stages, num_splits); decode
   at other batch sizes / contexts with and without split-KV;
3. prefill timing for a few shapes (TFLOP/s with causal FLOPs; torch SDPA on contiguous tensors
   as a baseline where it applies); KV store timing.

Times are medians of ``triton.testing.do_bench`` (L2 flushed before each run); decode is also
timed inside a CUDA graph (``do_bench_cudagraph``) which removes launch overhead.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from bench.attention_common import DEV, DTYPE, HKV, HQ, D, bench_ms, block_tables_for, rel_err  # noqa: E402
from bench.attention_prefill_store import (  # noqa: E402
    prefill_benchmarks,
    print_prefill,
    print_store,
    store_benchmarks,
)
from pdserve.common.ops import kv_store, paged_attention, paged_attention_prefill  # noqa: E402
from pdserve.common.ops.reference import (  # noqa: E402
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    store_kvcache_ref,
)

# decode (batch, context) points timed per layer with all layers in one CUDA graph
SCALING_SHAPES = [(1, 600), (1, 4096), (8, 600), (8, 4096), (32, 600), (32, 2048), (64, 600),
                  (64, 2048), (128, 600), (256, 600)]


# ----------------------------------------------------------------------------------------------
# 1. correctness
# ----------------------------------------------------------------------------------------------

def check_correctness(seed: int) -> dict:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    res: dict = {}
    bs, layers = 16, 4
    # decode
    batch = 64
    ctx = torch.randint(1, 2049, (batch,), generator=gen).tolist()
    ctx[:4] = [1, 16, 17, 2048]
    num_blocks = sum(-(-c // bs) for c in ctx) + 16
    kv = torch.randn(num_blocks, layers, 2, bs, HKV, D, device=DEV, dtype=DTYPE)
    kc, vc = kv[:, 1, 0], kv[:, 1, 1]
    bt = block_tables_for(batch, ctx, bs, num_blocks, gen)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, D ** -0.5)
    for splits in (None, 1, 4):
        out = torch.full_like(q, float("nan"))
        paged_attention.paged_attention_decode(q, kc, vc, bt, cl, D ** -0.5, out=out, num_splits=splits)
        res[f"decode_rel_err_splits_{splits}"] = rel_err(out, ref)
        res[f"decode_nan_splits_{splits}"] = bool(torch.isnan(out).any())
    # prefill with cached prefixes
    q_lens = torch.randint(1, 700, (8,), generator=gen).tolist() + [1, 128]
    pctx = [n + int(torch.randint(0, 1200, (1,), generator=gen)) for n in q_lens]
    num_blocks = sum(-(-c // bs) for c in pctx) + 16
    kv = torch.randn(num_blocks, layers, 2, bs, HKV, D, device=DEV, dtype=DTYPE)
    kc, vc = kv[:, 1, 0], kv[:, 1, 1]
    bt = block_tables_for(len(pctx), pctx, bs, num_blocks, gen)
    cl = torch.tensor(pctx, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q = torch.randn(sum(q_lens), HQ, D, device=DEV, dtype=DTYPE)
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, max(q_lens), D ** -0.5, out=out)
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, max(q_lens), D ** -0.5)
    res["prefill_rel_err"] = rel_err(out, ref)
    res["prefill_nan"] = bool(torch.isnan(out).any())
    # store
    n = 3000
    kv = torch.full((400, layers, 2, bs, HKV, D), float("nan"), device=DEV, dtype=DTYPE)
    key = torch.randn(n, HKV, D, device=DEV, dtype=DTYPE)
    value = torch.randn(n, HKV, D, device=DEV, dtype=DTYPE)
    slots = torch.randperm(400 * bs, device=DEV)[:n].to(torch.int32)
    slots[::5] = -1
    expect = kv.clone()
    store_kvcache_ref(key, value, expect[:, 1, 0], expect[:, 1, 1], slots)
    kv_store.store_kvcache(key, value, kv[:, 1, 0], kv[:, 1, 1], slots)
    res["store_exact"] = bool(torch.equal(torch.nan_to_num(kv, nan=1234.5), torch.nan_to_num(expect, nan=1234.5)))
    res["ok"] = (all(v < 1e-2 for k, v in res.items() if k.endswith("rel_err") or "rel_err_" in k)
                 and not any(v for k, v in res.items() if "nan" in k) and res["store_exact"])
    return res


# ----------------------------------------------------------------------------------------------
# 2. bandwidth
# ----------------------------------------------------------------------------------------------

def _copy_ms(n: int) -> float:
    """Median ms of one device-to-device copy of ``n`` bytes; the buffers are freed on return."""
    x = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    y = torch.empty_like(x)
    return bench_ms(lambda: y.copy_(x))


def copy_bandwidth() -> dict:
    n = 1 << 30
    ms = _copy_ms(n)
    torch.cuda.empty_cache()
    return {"bytes": n, "ms": ms, "gbps": 2 * n / (ms * 1e-3) / 1e9}


def decode_benchmarks(args, copy_gbps: float) -> dict:
    gen = torch.Generator().manual_seed(args.seed)
    bs, layers, batch, context = args.block_size, args.layers, args.batch, args.context
    ctx = [context] * batch
    num_blocks = batch * -(-context // bs) + 64
    kv_bytes = num_blocks * layers * 2 * bs * HKV * D * 2
    print(f"KV cache: [{num_blocks}, {layers}, 2, {bs}, {HKV}, {D}] bf16 = {kv_bytes / 2**30:.2f} GiB")
    kv = torch.empty(num_blocks, layers, 2, bs, HKV, D, device=DEV, dtype=DTYPE).normal_()
    layer = layers // 2
    kc, vc = kv[:, layer, 0], kv[:, layer, 1]
    layer_views = [(kv[:, i, 0], kv[:, i, 1]) for i in range(layers)]
    bt = block_tables_for(batch, ctx, bs, num_blocks, gen)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    q = torch.randn(batch, HQ, D, device=DEV, dtype=DTYPE)
    scale = D ** -0.5
    kv_read = 2 * sum(ctx) * HKV * D * 2
    max_splits = paged_attention.DECODE_MAX_SPLITS
    out = torch.empty_like(q)
    ws = paged_attention.alloc_decode_workspace(batch, HQ, D, max_splits, DEV)
    default_splits = paged_attention.decode_num_splits(batch, HKV, bt.shape[1] * bs, DEV)

    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, scale)

    def run(splits, **cfg):
        return lambda: paged_attention.paged_attention_decode(
            q, kc, vc, bt, cl, scale, out=out, workspace=ws, num_splits=splits, **cfg)

    res: dict = {"batch": batch, "context": context, "block_size": bs, "layers": layers,
                 "kv_bytes_read": kv_read, "default_num_splits": default_splits}
    run(default_splits)()
    res["rel_err"] = rel_err(out, ref)
    ms = bench_ms(run(default_splits))
    ms_graph = bench_ms(run(default_splits), graph=True)
    res["default"] = {"ms": ms, "gbps": kv_read / (ms * 1e-3) / 1e9,
                      "ms_cudagraph": ms_graph,
                      "gbps_cudagraph": kv_read / (ms_graph * 1e-3) / 1e9 if ms_graph == ms_graph else None}
    res["default"]["pct_of_copy"] = 100 * res["default"]["gbps"] / copy_gbps

    def all_layers(splits, q_, bt_, cl_, out_, **cfg):
        def fn():
            for kc_, vc_ in layer_views:
                paged_attention.paged_attention_decode(q_, kc_, vc_, bt_, cl_, scale, out=out_,
                                                       workspace=ws, num_splits=splits, **cfg)
        return fn

    # a whole decode step's attention: every layer once (L2 cold for each layer), in a graph
    ms_all = bench_ms(all_layers(default_splits, q, bt, cl, out), graph=True) / layers
    res["default"]["ms_per_layer_all_layers_cudagraph"] = ms_all
    res["default"]["gbps_all_layers_cudagraph"] = kv_read / (ms_all * 1e-3) / 1e9

    sweep = []
    if not args.no_sweep:
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    for splits in ((default_splits, 2) if default_splits == 1 else (default_splits,)):
                        cfg = dict(block_n=block_n, num_warps=warps, num_stages=stages)
                        try:
                            fn = run(splits, **cfg)
                            fn()
                            err = rel_err(out, ref)
                            t = bench_ms(fn)
                        except Exception as exc:  # noqa: BLE001 - e.g. out of shared memory
                            sweep.append({**cfg, "num_splits": splits, "error": repr(exc)[:200]})
                            continue
                        sweep.append({**cfg, "num_splits": splits, "ms": t, "rel_err": err,
                                      "gbps": kv_read / (t * 1e-3) / 1e9,
                                      "pct_of_copy": 100 * kv_read / (t * 1e-3) / 1e9 / copy_gbps})
        ok = [s for s in sweep if "ms" in s and s["rel_err"] < 1e-2]
        if ok:
            res["best"] = min(ok, key=lambda s: s["ms"])
    res["sweep"] = sweep

    # batch / context scaling: per-layer time of a whole step (all layers in one CUDA graph);
    # block ids drawn with replacement from the same pool
    scaling = []
    for b, c in SCALING_SHAPES:
        sgen = torch.Generator().manual_seed(args.seed + b * 7 + c)
        sctx = [c] * b
        sbt = block_tables_for(b, sctx, bs, num_blocks, sgen, unique=False)
        scl = torch.tensor(sctx, dtype=torch.int32, device=DEV)
        sq = torch.randn(b, HQ, D, device=DEV, dtype=DTYPE)
        sout = torch.empty_like(sq)
        byt = 2 * b * c * HKV * D * 2
        row = {"batch": b, "context": c, "kv_bytes_read": byt}
        auto = paged_attention.decode_num_splits(b, HKV, sbt.shape[1] * bs, DEV)
        for name, splits in (("split1", 1), ("auto", auto)):
            fn = all_layers(splits, sq, sbt, scl, sout)
            fn()
            t = bench_ms(fn, graph=True) / layers     # per layer, all layers in one graph
            row[name] = {"num_splits": splits, "us_per_layer": t * 1e3,
                         "gbps": byt / (t * 1e-3) / 1e9 if t == t else None}
        scaling.append(row)
    res["scaling"] = scaling
    del kv
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------

def _clean(o):
    """NaN -> None (strict JSON), recursively."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/attention_kernels.json", help="JSON output path")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-sweep", action="store_true", help="skip the decode config sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "device": props.name, "sm_count": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "geometry": {"q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": "bfloat16"},
    }
    print(f"{props.name}  torch {torch.__version__}  triton {triton.__version__}")

    result["correctness"] = check_correctness(args.seed)
    print("correctness:", json.dumps(result["correctness"]))

    result["copy"] = copy_bandwidth()
    copy_gbps = result["copy"]["gbps"]
    print(f"device copy (1 GiB, read+write): {result['copy']['ms']:.3f} ms = {copy_gbps:.0f} GB/s")

    dec = decode_benchmarks(args, copy_gbps)
    result["decode"] = dec
    d = dec["default"]
    print(f"\ndecode B={dec['batch']} ctx={dec['context']} bs={dec['block_size']} (one of {dec['layers']} layers)"
          f"  splits={dec['default_num_splits']}  rel_err={dec['rel_err']:.2e}")
    print(f"  default config: {d['ms'] * 1e3:.1f} us  {d['gbps']:.0f} GB/s  ({d['pct_of_copy']:.1f}% of copy)"
          f"  | cuda graph: {d['ms_cudagraph'] * 1e3:.1f} us  {d['gbps_cudagraph'] or float('nan'):.0f} GB/s")
    print(f"  all {dec['layers']} layers in one graph: {d['ms_per_layer_all_layers_cudagraph'] * 1e3:.1f} us/layer"
          f"  {d['gbps_all_layers_cudagraph']:.0f} GB/s")
    if dec.get("best"):
        b = dec["best"]
        print(f"  best of sweep:  {b['ms'] * 1e3:.1f} us  {b['gbps']:.0f} GB/s  ({b['pct_of_copy']:.1f}% of copy)"
              f"  block_n={b['block_n']} warps={b['num_warps']} stages={b['num_stages']} splits={b['num_splits']}")
        print("  sweep (us): " + "  ".join(
            f"n{s['block_n']}/w{s['num_warps']}/s{s['num_stages']}/p{s['num_splits']}="
            + (f"{s['ms'] * 1e3:.0f}" if "ms" in s else "ERR") for s in dec["sweep"]))
    print("\n  per layer, all layers in one CUDA graph:")
    print("  batch  ctx    split1 us  GB/s   | auto splits  us     GB/s")
    for r in dec["scaling"]:
        a, s1 = r["auto"], r["split1"]
        print(f"  {r['batch']:5d} {r['context']:5d}  {s1['us_per_layer']:9.1f} {s1['gbps'] or 0:6.0f}   |"
              f" {a['num_splits']:11d} {a['us_per_layer']:7.1f} {a['gbps'] or 0:6.0f}")

    result["prefill"] = prefill_benchmarks(args)
    print_prefill(result["prefill"])
    result["store"] = store_benchmarks(args)
    print_store(result["store"])

    result["wall_s"] = time.time() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_clean(result), indent=2))
    print(f"\nwrote {out}  ({result['wall_s']:.0f} s)")
    return 0 if result["correctness"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
