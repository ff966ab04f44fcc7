"""Fused temperature sampling (Gumbel-max) in one pass over the logits, for the common case.

``argmax(logits / T + G)`` with ``G`` i.i.d. standard Gumbel noise draws exactly from
``softmax(logits / T)``; rows with ``T == 0`` take the plain argmax (ties: lowest index). One
program per row reads its logits once (no fp32 copy, no softmax, no noise tensor in memory);
the noise comes from Triton's counter-based RNG keyed by a per-step ``seed`` and the element
index. Used by the sampler only when no row needs top-k/top-p/min-p, penalties, a per-request
seed or logprobs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["seed"])   # a new seed every step: never a new compile
def _gumbel_argmax_kernel(logits_ptr, temp_ptr, out_ptr, V, stride, seed, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    greedy = t == 0.0
    inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, t))
    best_val = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, row * V + cols)
        u = tl.maximum(u, 1e-10)
        g = -tl.log(-tl.log(u))
        val = x * inv_t + tl.where(greedy, 0.0, g)
        val = tl.where(mask, val, float("-inf"))
        m = tl.max(val, axis=0)
        i = tl.argmax(val, axis=0).to(tl.int64) + start
        better = m > best_val
        best_idx = tl.where(better, i, best_idx)
        best_val = tl.where(better, m, best_val)
    tl.store(out_ptr + row, best_idx)


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """logits: [B, V] (any float dtype); temperatures: [B] fp32 (0 = greedy) -> token ids [B] int64."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(B,)](logits, temperatures, out, V, logits.stride(0), seed,
                                BLOCK=4096, num_warps=8)
    return out
