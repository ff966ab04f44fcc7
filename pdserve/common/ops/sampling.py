"""Fused temperature sampling: one read of the logits, one random number per row.

Row ``T > 0`` draws ``softmax(logits / T)`` by inverse CDF over per-chunk maxima and masses
(Philox keyed by a per-step ``seed`` and the row); ``T == 0`` takes the argmax (lowest index on
ties). Nothing of size ``[B, V]`` is written. Used only when no row needs top-k/top-p/min-p,
penalties, a per-request seed or logprobs. Chosen over Gumbel-max by measurement: bench/NOTES.md.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048        # columns per (row, chunk) program of kernel 1; kernel 2 scans one chunk


@triton.jit
def _row_scale(temp_ptr, row):
    """(greedy, scale): base-2 logits are ``x * scale``; greedy rows keep the raw logits."""
    t = tl.load(temp_ptr + row)
    greedy = t == 0.0
    return greedy, tl.where(greedy, 1.0, 1.4426950408889634 / tl.where(greedy, 1.0, t))   # log2(e) / T


@triton.jit
def _chunk_stats_kernel(logits_ptr, temp_ptr, max_ptr, sum_ptr, arg_ptr, V, stride, num_chunks,
                        CHUNK: tl.constexpr):
    """Per (row, chunk): max of ``x * scale``, sum of ``exp2(x * scale - max)``, first argmax."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    greedy, scale = _row_scale(temp_ptr, row)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x_ptr = logits_ptr + row.to(tl.int64) * stride
    f = tl.load(x_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * scale
    m = tl.max(f, axis=0)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(tl.exp2(f - m), axis=0))
    tl.store(arg_ptr + out, tl.argmax(f, axis=0).to(tl.int64) + chunk * CHUNK)   # first on a tie


@triton.jit(do_not_specialize=["seed"])   # a new seed every step: never a new compile
def _pick_kernel(logits_ptr, temp_ptr, max_ptr, sum_ptr, arg_ptr, out_ptr, V, stride, seed,
                 num_chunks, CHUNK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    greedy, scale = _row_scale(temp_ptr, row)
    offs = tl.arange(0, BLOCK_C)
    c_mask = offs < num_chunks
    cm = tl.load(max_ptr + row * num_chunks + offs, mask=c_mask, other=float("-inf"))
    cs = tl.load(sum_ptr + row * num_chunks + offs, mask=c_mask, other=0.0)
    top = tl.max(cm, axis=0)
    # greedy: the chunk with the largest max (the first on a tie) and its argmax
    greedy_tok = tl.load(arg_ptr + row * num_chunks + tl.argmax(cm, axis=0))
    # sampled: chunk masses on one scale, then the chunk where the cumulative mass passes u
    w = tl.where(c_mask, cs * tl.exp2(cm - top), 0.0)
    cum = tl.cumsum(w, axis=0)
    u = tl.rand(seed, row) * tl.max(cum, axis=0)                # in [0, total)
    chunk = tl.minimum(tl.sum((cum <= u).to(tl.int32), axis=0), num_chunks - 1)
    target = u - tl.sum(tl.where(offs < chunk, w, 0.0), axis=0)
    # inside that chunk: the first token whose cumulative mass passes what is left of u
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    valid = cols < V
    x_ptr = logits_ptr + row.to(tl.int64) * stride
    f = tl.load(x_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32) * scale
    e = tl.where(valid, tl.exp2(f - top), 0.0)
    hit = (tl.cumsum(e, axis=0) > target) & valid
    first = tl.min(tl.where(hit, cols, V), axis=0)
    last = tl.max(tl.where(e > 0.0, cols, 0), axis=0)          # rounding fallback: last with mass
    sampled = tl.where(first < V, first, last).to(tl.int64)
    tl.store(out_ptr + row, tl.where(greedy, greedy_tok, sampled))


def temperature_sample(logits: torch.Tensor, temperatures: torch.Tensor, seed: int) -> torch.Tensor:
    """logits: [B, V] (any float dtype, last dim contiguous); temperatures: [B] fp32 (0 = greedy)
    -> token ids [B] int64."""
    B, V = logits.shape
    assert logits.stride(1) == 1
    num_chunks = triton.cdiv(V, CHUNK)
    chunk_max = torch.empty(B, num_chunks, dtype=torch.float32, device=logits.device)
    chunk_sum = torch.empty(B, num_chunks, dtype=torch.float32, device=logits.device)
    args = torch.empty(B, num_chunks, dtype=torch.int64, device=logits.device)
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    _chunk_stats_kernel[(B, num_chunks)](logits, temperatures, chunk_max, chunk_sum, args, V,
                                         logits.stride(0), num_chunks, CHUNK=CHUNK, num_warps=4)
    _pick_kernel[(B,)](logits, temperatures, chunk_max, chunk_sum, args, out, V, logits.stride(0), seed,
                       num_chunks, CHUNK=CHUNK, BLOCK_C=max(2, triton.next_power_of_2(num_chunks)),
                       num_warps=8)
    return out
