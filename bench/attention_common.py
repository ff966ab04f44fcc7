"""Shared pieces of the attention kernel benchmarks (bench/attention_kernels.py,
bench/attention_prefill_store.py): the Qwen3-0.6B attention geometry, relative error, timing and
random block tables."""
from __future__ import annotations

import torch
import triton
from triton.testing import do_bench

DEV = "cuda"
HQ, HKV, D = 16, 8, 128          # Qwen3-0.6B
DTYPE = torch.bfloat16


def rel_err(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def bench_ms(fn, graph: bool = False) -> float:
    if graph:
        try:
            return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
        except Exception as exc:  # noqa: BLE001 - report and fall back
            print(f"  (cuda graph timing failed: {exc!r})")
            return float("nan")
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def block_tables_for(batch: int, ctx: list[int], block_size: int, num_blocks: int,
                     gen: torch.Generator, unique: bool = True) -> torch.Tensor:
    need = [-(-c // block_size) for c in ctx]
    width = max(need)
    if unique:
        assert sum(need) <= num_blocks, (sum(need), num_blocks)
        perm = torch.randperm(num_blocks, generator=gen)
    bt = torch.full((batch, width), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        if unique:
            bt[b, :n] = perm[pos:pos + n].to(torch.int32)
        else:
            bt[b, :n] = torch.randint(0, num_blocks, (n,), generator=gen, dtype=torch.int32)
        pos += n
    return bt.to(DEV)
