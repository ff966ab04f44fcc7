"""Fused elementwise Triton kernels for the decoder layer, each with its torch reference:
``rms_norm`` (optionally fused residual add), ``silu_and_mul`` and ``qk_norm_rope`` (split
QKV, per-head RMSNorm, rotary; v a view of ``qkv``, or a new tensor when QKV comes as split-K
partial sums). Numerics follow the checkpoints' reference (fp32 statistics, dtype rounding before the
weight). No host syncs; CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.ops.fp8 import is_fp8
from pdserve.common.ops.kv_store import FP8_LIMIT
from pdserve.common.ops.pdl import launch_args, pdl_available


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                     stride_x, stride_res, stride_out, stride_res_out,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, H] -> norm(x) or (norm(x + residual), x + residual)."""
    T, H = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual if residual is not None else x
    _rms_norm_kernel[(T,)](x, res, weight, out, res_out, H, eps, x.stride(0), res.stride(0), out.stride(0),
                           res_out.stride(0), HAS_RESIDUAL=residual is not None,
                           BLOCK=triton.next_power_of_2(H), num_warps=4 if H <= 2048 else 8)
    return (out, res_out) if residual is not None else out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] (gate then up) -> [T, I]."""
    T, two_i = x.shape
    inter = two_i // 2
    out = torch.empty(T, inter, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(T, triton.cdiv(inter, block))](x, out, inter, x.stride(0), out.stride(0), BLOCK=block,
                                                     num_warps=4)
    return out


@triton.jit
def _load_qkv(ptrs, mask, part_stride, PARTS: tl.constexpr, dtype: tl.constexpr):
    """A slice of a token's QKV row: as stored (``PARTS == 0``), or the sum of ``PARTS`` fp32
    split-K partials ``part_stride`` elements apart, rounded to ``dtype`` as a GEMM rounds its output."""
    if PARTS == 0:
        return tl.load(ptrs, mask=mask, other=0.0)
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, PARTS):
        acc += tl.load(ptrs + s * part_stride, mask=mask, other=0.0)
    return acc.to(dtype)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_out_ptr,
                         slot_ptr, kc_ptr, vc_ptr, stride_kc_b, stride_kc_t, stride_kc_h,
                         stride_vc_b, stride_vc_t, stride_vc_h,
                         stride_qkv, stride_cos, eps, NUM_Q: tl.constexpr, NUM_KV: tl.constexpr,
                         HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr,
                         STORE_KV: tl.constexpr, CACHE_BLOCK: tl.constexpr, BLOCK_KV: tl.constexpr,
                         v_out_ptr, part_stride, PARTS: tl.constexpr = 0, LOAD_V: tl.constexpr = False,
                         PDL: tl.constexpr = False, inv_k_scale=1.0, inv_v_scale=1.0, KV_FP8: tl.constexpr = False):
    if PDL:                                 # release the next kernel now; wait for qkv
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    tok = tl.program_id(0)
    half: tl.constexpr = HEAD_DIM // 2
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, half)
    num_heads: tl.constexpr = NUM_Q + NUM_KV
    hmask = heads < num_heads
    pos = tl.load(pos_ptr + tok)
    cos = tl.load(cos_ptr + pos * stride_cos + dims)                     # [half] fp32
    sin = tl.load(sin_ptr + pos * stride_cos + dims)
    base = qkv_ptr + tok * stride_qkv + heads[:, None] * HEAD_DIM + dims[None, :]
    dtype = q_out_ptr.dtype.element_ty
    x1 = _load_qkv(base, hmask[:, None], part_stride, PARTS, dtype)
    x2 = _load_qkv(base + half, hmask[:, None], part_stride, PARTS, dtype)
    if HAS_NORM:
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM
        inv = tl.rsqrt(var + eps)[:, None]
        is_q = heads < NUM_Q
        w1 = tl.where(is_q[:, None], tl.load(qw_ptr + dims)[None, :], tl.load(kw_ptr + dims)[None, :])
        w2 = tl.where(is_q[:, None], tl.load(qw_ptr + half + dims)[None, :], tl.load(kw_ptr + half + dims)[None, :])
        x1 = (w1.to(tl.float32) * (f1 * inv).to(dtype).to(tl.float32)).to(dtype)
        x2 = (w2.to(tl.float32) * (f2 * inv).to(dtype).to(tl.float32)).to(dtype)
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    o1 = (f1 * cos[None, :] - f2 * sin[None, :]).to(dtype)
    o2 = (f2 * cos[None, :] + f1 * sin[None, :]).to(dtype)
    q_mask = (heads < NUM_Q)[:, None]
    q_base = q_out_ptr + tok * NUM_Q * HEAD_DIM + heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(q_base, o1, mask=q_mask)
    tl.store(q_base + half, o2, mask=q_mask)
    k_heads = heads - NUM_Q
    k_mask = ((heads >= NUM_Q) & hmask)[:, None]
    k_base = k_out_ptr + tok * NUM_KV * HEAD_DIM + k_heads[:, None] * HEAD_DIM + dims[None, :]
    tl.store(k_base, o1, mask=k_mask)
    tl.store(k_base + half, o2, mask=k_mask)
    if LOAD_V:                              # STORE_KV or PARTS > 0
        kv_heads = tl.arange(0, BLOCK_KV)
        full = tl.arange(0, HEAD_DIM)
        kv_mask = (kv_heads < NUM_KV)[:, None]
        v = _load_qkv(qkv_ptr + tok * stride_qkv + (NUM_Q + NUM_KV) * HEAD_DIM + kv_heads[:, None] * HEAD_DIM
                      + full[None, :], kv_mask, part_stride, PARTS, dtype)
        if PARTS > 0:                       # v is no view of a stored qkv: write it out
            tl.store(v_out_ptr + tok * NUM_KV * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + full[None, :], v,
                     mask=kv_mask)
        if STORE_KV:
            # the token's K (as just computed) and V into the paged cache; slot < 0: padding
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            blk = slot // CACHE_BLOCK
            off = slot % CACHE_BLOCK
            kc = kc_ptr + blk * stride_kc_b + off * stride_kc_t + k_heads[:, None] * stride_kc_h + dims[None, :]
            kc_mask = k_mask & ((heads * 0 + slot) >= 0)[:, None]
            k1, k2, vs = o1, o2, v
            if KV_FP8:                      # K / k_scale, V / v_scale, saturated (ops/fp8.py)
                k1 = tl.clamp(o1.to(tl.float32) * inv_k_scale, -FP8_LIMIT, FP8_LIMIT)
                k2 = tl.clamp(o2.to(tl.float32) * inv_k_scale, -FP8_LIMIT, FP8_LIMIT)
                vs = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_LIMIT, FP8_LIMIT)
            tl.store(kc, k1.to(kc_ptr.dtype.element_ty), mask=kc_mask)
            tl.store(kc + half, k2.to(kc_ptr.dtype.element_ty), mask=kc_mask)
            v_mask = kv_mask & ((kv_heads * 0 + slot) >= 0)[:, None]
            tl.store(vc_ptr + blk * stride_vc_b + off * stride_vc_t + kv_heads[:, None] * stride_vc_h
                     + full[None, :], vs.to(vc_ptr.dtype.element_ty), mask=v_mask)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 num_q: int, num_kv: int, head_dim: int, q_weight: torch.Tensor | None = None,
                 k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                 k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None, pdl: bool = False, dtype: torch.dtype | None = None,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv: [T, (Hq+2Hkv)*D]; cos/sin: [P, D] fp32 caches -> q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D] (a view).

    ``qkv`` may also be the fp32 split-K partial sums of the QKV projection, [S, T, (Hq+2Hkv)*D]
    (pdserve/common/ops/dataflow.py): they are added up and rounded to ``dtype`` (the model's),
    where the unsplit projection rounds its output, and v is then a new tensor.
    With ``k_cache``/``v_cache`` and ``slot_mapping[T]`` it also stores K and V into the paged
    cache (negative slots skipped), as ``kv_store.store_kvcache`` would (an FP8 cache gets
    ``K / k_scale`` and ``V / v_scale``). ``pdl``: launched with
    programmatic dependent launch where ``pdl.pdl_available`` (pdserve/common/ops/pdl.py).
    """
    parts = qkv.shape[0] if qkv.dim() == 3 else 0
    if parts:
        assert qkv.dtype == torch.float32 and qkv.is_contiguous() and dtype is not None, (qkv.dtype, dtype)
    else:
        assert dtype in (None, qkv.dtype), (qkv.dtype, dtype)
    dtype = dtype or qkv.dtype
    T = qkv.shape[-2]
    q = torch.empty(T, num_q, head_dim, dtype=dtype, device=qkv.device)
    k = torch.empty(T, num_kv, head_dim, dtype=dtype, device=qkv.device)
    v = (torch.empty(T, num_kv, head_dim, dtype=dtype, device=qkv.device) if parts
         else qkv[:, (num_q + num_kv) * head_dim:].view(T, num_kv, head_dim))
    has_norm = q_weight is not None
    qw = q_weight if has_norm else cos
    kw = k_weight if has_norm else cos
    store = k_cache is not None
    if k_cache is not None:
        assert v_cache is not None and slot_mapping is not None and slot_mapping.shape == (T,)
        assert k_cache.shape[2:] == (num_kv, head_dim) and v_cache.shape == k_cache.shape
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        kc, vc, slots = k_cache, v_cache, slot_mapping
    else:
        kc, vc, slots = q, q, positions                    # unused
    kc_strides = (kc.stride(0), kc.stride(1), kc.stride(2)) if store else (0, 0, 0)
    vc_strides = (vc.stride(0), vc.stride(1), vc.stride(2)) if store else (0, 0, 0)
    _qk_norm_rope_kernel[(T,)](qkv, positions, cos, sin, qw, kw, q, k, slots, kc, vc,
                               *kc_strides, *vc_strides, qkv.stride(-2), cos.stride(0), eps,
                               NUM_Q=num_q, NUM_KV=num_kv, HEAD_DIM=head_dim, HAS_NORM=has_norm,
                               BLOCK_H=triton.next_power_of_2(num_q + num_kv), STORE_KV=store,
                               CACHE_BLOCK=kc.shape[1] if store else 1,
                               BLOCK_KV=triton.next_power_of_2(num_kv), v_out_ptr=v,
                               part_stride=qkv.stride(0) if parts else 0, PARTS=parts,
                               LOAD_V=store or parts > 0, num_warps=4,
                               inv_k_scale=1.0 / k_scale, inv_v_scale=1.0 / v_scale,
                               KV_FP8=store and is_fp8(kc),
                               **launch_args(pdl and pdl_available(qkv.device)))
    return q, k, v
