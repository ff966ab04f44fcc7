"""How fast can a decode step read? The read-only bandwidth ceiling against the copy bandwidth
the bytes floor uses, and the decode attention kernel against both, by KV cache layout and tile
config (lab probe for issue 20).

1. Copy bandwidth (read + write, as bench.common) and a read-only sum over a 2 GiB buffer: torch's
   own reduction and a Triton grid-stride kernel over several tile / warp / grid configs, each
   checked against a float64 sum first.
2. ``paged_attention_decode`` on uniform and W-nano-like ragged batches, with the cache in the
   engine's per-layer view's token-major layout ``[num_blocks, block_size, Hkv, D]`` (a head's
   256-byte rows 2 KiB apart) and in a head-major layout ``[num_blocks, Hkv, block_size, D]`` (a
   head's block contiguous; the same kernel through strides), over (BLOCK_N, warps, stages)
   configs. K and V are two tensors here; in the engine's pool a block's K and V lie together. Every
   output is poisoned with NaN, then checked against the torch reference on fresh random inputs.
   Bandwidth counts the KV bytes the batch must read; CUDA-graph timing (median replay).

  python -m bench.read_bw_probe --out bench/results/read_bw/read_bw_probe_h100.json
"""
from __future__ import annotations

import argparse
import random

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth, graph_time, write_result
from pdserve.common.ops.paged_attention import alloc_decode_workspace, decode_num_splits, paged_attention_decode
from pdserve.common.ops.reference import paged_attention_decode_ref

HKV, HQ, D, BLOCK = 8, 16, 128, 256
ATTN_CONFIGS = [(64, 4, 3), (64, 8, 3), (64, 4, 4), (128, 4, 3), (128, 8, 3), (128, 4, 2), (32, 4, 4),
                (256, 8, 2)]
READ_CONFIGS = [(4096, 4, 4), (8192, 4, 4), (8192, 8, 4), (16384, 8, 4), (8192, 8, 8), (16384, 8, 8),
                (8192, 8, 0), (16384, 16, 0)]       # (elements a tile, warps, programs per SM; 0 = one tile each)


@triton.jit
def _read_sum_kernel(x_ptr, part_ptr, n, BLOCK_E: tl.constexpr):
    """Grid-stride read of ``x[n]``; program ``p`` writes its fp32 partial sum to ``part[p]``."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK_E
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for start in range(pid * BLOCK_E, n, step):
        offs = start + tl.arange(0, BLOCK_E)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


def read_rows(n_bytes: int) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(n_bytes // 2, dtype=torch.bfloat16, device="cuda")
    n = x.numel()
    assert n < 2 ** 31, "the read kernel's offsets are 32-bit: at most 4 GiB"
    ref = x.double().sum().item()
    scale = x.double().abs().sum().item()
    rows = [{"way": "torch.sum", "GBps": n_bytes / graph_time(lambda: x.sum(dtype=torch.float32), replays=20) / 1e9}]
    for block_e, warps, per_sm in READ_CONFIGS:
        grid = per_sm * sms if per_sm else triton.cdiv(n, block_e)
        part = torch.full((grid,), float("nan"), dtype=torch.float32, device="cuda")

        def run(block_e=block_e, warps=warps, grid=grid, part=part):
            _read_sum_kernel[(grid,)](x, part, n, BLOCK_E=block_e, num_warps=warps)
        run()
        err = abs(part.double().sum().item() - ref) / scale
        assert err < 1e-5, f"read sum error {err} for {(block_e, warps, per_sm)}"
        secs = graph_time(run, replays=20)
        rows.append({"way": f"triton tile={block_e} warps={warps} grid={'tiles' if not per_sm else f'{per_sm}xSM'}",
                     "GBps": n_bytes / secs / 1e9, "rel_err": err})
    return rows


def _caches(layout: str, num_blocks: int):
    """K and V caches as ``[num_blocks, BLOCK, HKV, D]`` views in the given physical layout."""
    if layout == "token-major":
        return [torch.randn(num_blocks, BLOCK, HKV, D, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    return [torch.randn(num_blocks, HKV, BLOCK, D, dtype=torch.bfloat16, device="cuda").permute(0, 2, 1, 3)
            for _ in range(2)]


def attention_rows(cases: dict[str, list[int]], copy_gbps: float, read_gbps: float) -> list[dict]:
    rows = []
    for layout in ("token-major", "head-major"):
        for name, lens in cases.items():
            B = len(lens)
            max_blocks = -(-max(lens) // BLOCK)
            num_blocks = B * max_blocks + 16
            k_cache, v_cache = _caches(layout, num_blocks)
            perm = torch.randperm(num_blocks, device="cuda")
            bt = perm[:B * max_blocks].view(B, max_blocks).to(torch.int32).contiguous()
            cl = torch.tensor(lens, dtype=torch.int32, device="cuda")
            splits = decode_num_splits(B, HKV, max(lens), "cuda")
            ws = alloc_decode_workspace(B, HQ, D, max(splits, 2), "cuda")
            nbytes = sum(lens) * HKV * D * 2 * 2
            for block_n, warps, stages in ATTN_CONFIGS:
                q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
                out = torch.full_like(q, float("nan"))
                cfg = dict(out=out, workspace=ws, num_splits=splits, block_n=block_n, num_warps=warps,
                           num_stages=stages)
                try:
                    paged_attention_decode(q, k_cache, v_cache, bt, cl, D ** -0.5, **cfg)
                except triton.runtime.errors.OutOfResources as exc:
                    rows.append({"layout": layout, "case": name, "config": [block_n, warps, stages],
                                 "skipped": str(exc)[:120]})
                    continue
                ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, cl, D ** -0.5)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                assert err < 1e-2, f"attention rel err {err} ({layout}, {name}, {cfg})"
                secs = _attention_secs(q, k_cache, v_cache, bt, cl, cfg)
                gbps = nbytes / secs / 1e9
                rows.append({"layout": layout, "case": name, "batch": B, "mean_ctx": sum(lens) / B,
                             "splits": splits, "config": [block_n, warps, stages], "rel_err": err,
                             "us": secs * 1e6, "GBps": gbps, "of_copy": gbps / copy_gbps,
                             "of_read": gbps / read_gbps})
            k_cache = v_cache = None
            torch.cuda.empty_cache()
    return rows


def _attention_secs(q, k_cache, v_cache, bt, cl, cfg: dict) -> float:
    return graph_time(lambda: paged_attention_decode(q, k_cache, v_cache, bt, cl, D ** -0.5, **cfg), replays=30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--read-gib", type=float, default=2.0)
    p.add_argument("--out", default="bench/results/read_bw/read_bw_probe.json")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    rng = random.Random(0)
    copy_gbps = copy_bandwidth(1 << 31) / 1e9
    reads = read_rows(int(a.read_gib * (1 << 30)))
    torch.cuda.empty_cache()
    read_gbps = max(r["GBps"] for r in reads)
    cases = {"b256_ctx600": [600] * 256, "b64_ctx1200": [1200] * 64,
             "b256_ragged": [rng.randint(100, 1024) + rng.randint(0, 400) for _ in range(256)],
             "b128_ragged": [rng.randint(100, 1024) + rng.randint(100, 700) for _ in range(128)]}
    for lens in cases.values():
        lens.sort(reverse=True)                       # the engine orders rows longest first
    attn = attention_rows(cases, copy_gbps, read_gbps)
    write_result(a.out, {"copy_GBps": copy_gbps, "read_GBps_best": read_gbps, "read": reads, "attention": attn})
    print(f"copy {copy_gbps:.0f} GB/s; read-only best {read_gbps:.0f} GB/s")
    for r in reads:
        print(f"  {r['way']:<44} {r['GBps']:7.0f}")
    for r in attn:
        if "skipped" in r:
            print(f"  {r['layout']:<12} {r['case']:<12} {r['config']} skipped")
            continue
        print(f"  {r['layout']:<12} {r['case']:<12} {str(r['config']):<14} {r['us']:8.1f} us {r['GBps']:6.0f} GB/s"
              f"  {r['of_copy']:.3f} copy  {r['of_read']:.3f} read")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
