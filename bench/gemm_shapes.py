"""The decode step's GEMMs alone (bf16, the shapes of ``--model``), each way torch can run them,
timed inside CUDA graphs (no launch cost): which weight layout / BLAS library reads the weights
fastest at decode batch sizes. Results are checked against F.linear before timing. Each row
also carries its compute floor (2*M*N*K over ``matmul_throughput``): at M ~ 256 a bf16 GEMM
is at the ridge, as compute-bound as it is bandwidth-bound.

    python -m bench.gemm_shapes --model qwen3-0.6b --out bench/results/gemm_shapes_h100.json
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import copy_bandwidth, graph_time, matmul_throughput, write_result
from pdserve.common.loader import resolve_model


def gemm_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the four projections of one decoder layer of ``model`` (preset or config path)."""
    c = resolve_model(model).config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size), "o_proj": (c.hidden_size, q),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size)}

REPEAT = 50


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="preset name or config.json path")
    p.add_argument("--batches", default="1,16,64,128,256")
    p.add_argument("--out", default="bench/results/gemm_shapes.json")
    args = p.parse_args(argv)
    bandwidth, flops = copy_bandwidth(), matmul_throughput()
    rows = []
    for name, (n, k) in gemm_shapes(args.model).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        w_t = w.t().contiguous()                                   # [K, N]: x @ w_t, the NN layout
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            # defaults bind this row's tensors (each fn is timed before the loop moves on)
            ways = {"linear_TN": lambda x=x, w=w: F.linear(x, w), "mm_NN": lambda x=x, w_t=w_t: torch.mm(x, w_t)}
            row = {"gemm": name, "M": m, "N": n, "K": k, "floor_us": 1e6 * w.numel() * 2 / bandwidth,
                   "compute_floor_us": 1e6 * 2 * m * n * k / flops}
            for way, fn in ways.items():
                torch.testing.assert_close(fn(), ref, rtol=2e-2, atol=2e-2)
                row[f"{way}_us"] = 1e6 * graph_time(fn, calls=REPEAT, replays=5)
            blas_default = torch.backends.cuda.preferred_blas_library()
            for lib in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(lib)
                row[f"linear_TN_{lib}_us"] = 1e6 * graph_time(lambda x=x, w=w: F.linear(x, w),
                                                              calls=REPEAT, replays=5)
            torch.backends.cuda.preferred_blas_library(blas_default)   # the next rows' default
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            rows.append(row)
    write_result(args.out, {"copy_bandwidth_GBps": bandwidth / 1e9, "matmul_TFLOPS": flops / 1e12,
                            "model": args.model, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
