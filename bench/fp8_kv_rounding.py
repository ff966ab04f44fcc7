"""How often a summation-order difference moves a K/V value to another e4m3 value (CPU).

A Qwen3-0.6B-shaped K/V projection (hidden 1024 -> K and V of 8 heads x 128, float32, RMS-normed
inputs, dummy-weight scale) summed in one pass and as two 512-wide split-K partials, as GEMMs of
different shapes may sum it: the share of outputs that differ in float32, and the share that round
to another e4m3 value (per-tensor scale 1.0), raw and after the per-head RMSNorm (qk-norm).

    python -m bench.fp8_kv_rounding [--rows 2048]
"""
from __future__ import annotations

import argparse

import torch

from pdserve.common.ops.fp8 import quantize_fp8

HIDDEN, KV_HEADS, HEAD_DIM, LAYERS, SPLIT = 1024, 8, 128, 28, 512


def head_rms_norm(y: torch.Tensor) -> torch.Tensor:
    """Each head's vector over its RMS (the K norm of Qwen3, without its weight)."""
    h = y.view(y.shape[0], -1, HEAD_DIM)
    return (h / h.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()).view_as(y)


def shares(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Of ``a``'s values: the share unequal to ``b``'s in float32, their median relative
    difference, and the share whose e4m3 roundings differ."""
    differ = a != b
    rel = ((a - b).abs() / a.abs().clamp_min(1e-12))[differ]
    e4m3 = quantize_fp8(a).view(torch.uint8) != quantize_fp8(b).view(torch.uint8)
    return {"float32_differ": differ.float().mean().item(), "median_rel_diff": rel.median().item(),
            "e4m3_differ": e4m3.float().mean().item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    x = torch.randn(args.rows, HIDDEN)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    w = torch.randn(2 * KV_HEADS * HEAD_DIM, HIDDEN) * 0.02
    one_pass = x @ w.T
    split_k = x[:, :SPLIT] @ w[:, :SPLIT].T + x[:, SPLIT:] @ w[:, SPLIT:].T
    per_token = LAYERS * 2 * KV_HEADS * HEAD_DIM
    for name, a, b in (("raw", one_pass, split_k), ("head-normed", head_rms_norm(one_pass), head_rms_norm(split_k))):
        s = shares(a, b)
        print(f"{name}: {s['float32_differ']:.1%} differ in float32 (median relative difference "
              f"{s['median_rel_diff']:.1e}); {s['e4m3_differ']:.2e} round to another e4m3 value, "
              f"{s['e4m3_differ'] * per_token:.2f} per token of Qwen3-0.6B ({per_token:,} K/V values)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
