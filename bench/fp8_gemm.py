"""The FP8 projection against bf16 at decode and prefill row counts, on one GPU: CUDA-event
time of ``Fp8Linear`` (per-token quantization + ``torch._scaled_mm``) and of ``F.linear`` in bf16
for the Qwen3-8B projections, each replayed from a CUDA graph (as decode steps run): the profile
that tells whether ``_scaled_mm`` or a Triton FP8 GEMM should serve the decode batch sizes.

    python -m bench.fp8_gemm --out bench/results/fp8_gemm_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import graph_time, write_result
from pdserve.common.layers.fp8_linear import Fp8Linear

# (name, in_features, out_features) of a Qwen3-8B layer's merged projections
SHAPES = (("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 24576), ("down", 12288, 4096))
ROWS = (1, 8, 32, 64, 128, 256, 512, 2048)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/fp8_gemm.json")
    args = p.parse_args(argv)
    rows_out = []
    for name, k, n in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(lin)
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = graph_time(lambda x=x, w=lin.weight: F.linear(x, w), calls=20) * 1e6
            fp8_us = graph_time(lambda x=x, f=fp8: f(x), calls=20) * 1e6
            rows_out.append({"proj": name, "rows": m, "bf16_us": bf16_us, "fp8_us": fp8_us,
                             "speedup": bf16_us / fp8_us})
            print(f"{name:8s} rows {m:5d}  bf16 {bf16_us:8.1f} us  fp8 {fp8_us:8.1f} us  x{bf16_us / fp8_us:.2f}")
    write_result(args.out, {"shapes": SHAPES, "results": rows_out})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
