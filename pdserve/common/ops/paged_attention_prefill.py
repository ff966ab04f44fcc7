"""Triton varlen prefill over the paged KV cache (the cache layout and limits of
paged_attention.py). Grid ``(cdiv(max_seqlen_q, BLOCK_M), Hq, B)``: one program per query tile
of one head of one sequence, causal with offset ``context_lens[b] - q_len_b``; fp32 softmax
statistics and accumulators, output in q's dtype; no host sync. An FP8 cache is read as
paged_attention.py reads it (``k_scale`` in the softmax scale, ``v_scale`` on the output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.ops.paged_attention import LOG2E, check_caches, dot_precision, kv_scales

__all__ = ["paged_attention_prefill"]


@triton.jit
def _prefill_tile(
    acc, l_i, m_i, q, k_base, v_base, bt_row, n_begin, n_end, pos, ctx,
    stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for n0 in range(n_begin, n_end, BLOCK_N):
        t = n0 + offs_n
        if MASKED:
            t_mask = t < ctx
            blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + t // BLOCK_SIZE).to(tl.int64)
        in_blk = (t % BLOCK_SIZE).to(tl.int64)
        k_ptrs = k_base + (blk * stride_kb + in_blk * stride_kt)[:, None] + offs_d[None, :]
        v_ptrs = v_base + (blk * stride_vb + in_blk * stride_vt)[:, None] + offs_d[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=t_mask[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            visible = (t[None, :] <= pos[:, None]) & t_mask[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=t_mask[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["stride_btb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, cu_ptr, cl_ptr, bt_ptr, out_ptr,
    qk_scale, v_scale,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # Heaviest (last) query tiles first: with causal masking they have the most keys.
    m_tile = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)

    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    m0 = m_tile * BLOCK_M
    if m0 < q_len:
        ctx = tl.load(cl_ptr + b)
        offset = ctx - q_len                      # absolute position of query 0
        kvh = h // GROUP
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        m_mask = offs_m < q_len
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None], other=0.0)
        pos = offset + offs_m

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        bt_row = bt_ptr + b.to(tl.int64) * stride_btb
        k_base = k_ptr + kvh.to(tl.int64) * stride_kh
        v_base = v_ptr + kvh.to(tl.int64) * stride_vh
        # keys < offset + m0 are visible to every query of the tile and all < ctx
        n_full = ((offset + m0) // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, k_base, v_base, bt_row, 0, n_full, pos, ctx,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION)
        n_end = tl.minimum(ctx, offset + m0 + BLOCK_M)
        acc, l_i, m_i = _prefill_tile(
            acc, l_i, m_i, q, k_base, v_base, bt_row, n_full, n_end, pos, ctx,
            stride_kb, stride_kt, stride_vb, stride_vt, qk_scale,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION)

        denom = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc * v_scale / denom[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def _prefill_config(dtype: torch.dtype, head_dim: int, max_seqlen_q: int,
                    device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) defaults for prefill."""
    if device.type != "cuda":
        return (16 if max_seqlen_q <= 16 else 32), 32, 4, 1
    if dtype == torch.float32:
        return (16 if max_seqlen_q <= 16 else 64), 32, 4, 2
    if max_seqlen_q <= 16:
        return 16, 64, 4, 3
    if max_seqlen_q <= 64:
        return 64, 64, 4, 3
    if head_dim <= 128:
        # chosen by measurement: bench/NOTES.md
        return 64, 32, 4, 2
    return 128, 64, 8, 3


def paged_attention_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            block_tables: torch.Tensor, max_seqlen_q: int, scale: float,
                            *, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None,
                            num_stages: int | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """Varlen prefill over the paged cache, causal with offset ``context_lens[b] - q_len_b``.

    ``q[T, Hq, D]``: the B sequences' new tokens back to back (``cu_seqlens_q[B+1]``), their K/V
    already in the cache; ``max_seqlen_q`` (host int) sizes the grid; ``out``: optional
    ``[T, Hq, D]``. Requires ``context_lens[b] >= q_len_b``. No host sync.
    """
    T = q.shape[0]
    Hq, Hkv, D, block_size = check_caches(q, k_cache, v_cache)
    B = cu_seqlens_q.shape[0] - 1
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        assert out.shape == q.shape and out.stride(-1) == 1, (out.shape, q.shape)
    if T == 0 or B <= 0 or max_seqlen_q <= 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert block_tables.stride(-1) == 1
    cfg_m, cfg_n, cfg_w, cfg_s = _prefill_config(q.dtype, D, max_seqlen_q, q.device)
    block_m = block_m or cfg_m
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_w
    num_stages = num_stages or cfg_s
    grid = (triton.cdiv(max_seqlen_q, block_m), Hq, B)
    k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale)
    _prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out,
        float(scale) * LOG2E * k_scale, v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
