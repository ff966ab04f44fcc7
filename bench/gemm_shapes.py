"""The decode step's GEMMs alone (Qwen3-0.6B shapes, bf16), each way torch can run them, timed
inside CUDA graphs (no launch cost): which weight layout / BLAS library reads the weights
fastest at decode batch sizes. Results are checked against F.linear before timing.

    python -m bench.gemm_shapes --out bench/results/gemm_shapes_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import copy_bandwidth, graph_time, write_result

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
REPEAT = 50


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,16,64,128,256")
    p.add_argument("--out", default="bench/results/gemm_shapes.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        w_t = w.t().contiguous()                                   # [K, N]: x @ w_t, the NN layout
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            ways = {"linear_TN": lambda: F.linear(x, w), "mm_NN": lambda: torch.mm(x, w_t)}
            row = {"gemm": name, "M": m, "N": n, "K": k, "floor_us": 1e6 * w.numel() * 2 / bandwidth}
            for way, fn in ways.items():
                torch.testing.assert_close(fn(), ref, rtol=2e-2, atol=2e-2)
                row[f"{way}_us"] = 1e6 * graph_time(fn, calls=REPEAT, replays=5)
            blas_default = torch.backends.cuda.preferred_blas_library()
            for lib in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"linear_TN_{lib}_us"] = 1e6 * graph_time(lambda: F.linear(x, w), calls=REPEAT, replays=5)
            torch.backends.cuda.preferred_blas_library(blas_default)   # the next rows' default
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            rows.append(row)
    write_result(args.out, {"copy_bandwidth_GBps": bandwidth / 1e9, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
