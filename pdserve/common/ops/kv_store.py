"""Triton kernel writing new tokens' K/V ``[N, Hkv, D]`` (head dim contiguous) into paged
``[num_blocks, block_size, Hkv, D]`` caches at ``slot_mapping[N]``; negative slots are skipped,
values cast to the cache dtype (an FP8 cache: divided by the per-tensor ``k_scale`` /
``v_scale`` and saturated, as ops/fp8.py). No allocation, no host sync: CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.ops.fp8 import FP8_MAX, is_fp8

__all__ = ["store_kvcache", "FP8_LIMIT"]

FP8_LIMIT = tl.constexpr(FP8_MAX)       # the saturation bound, as the kernels see it


@triton.jit
def _store_kvcache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_key_n, stride_key_h, stride_value_n, stride_value_h,
    stride_kc_b, stride_kc_t, stride_kc_h,
    stride_vc_b, stride_vc_t, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_HD: tl.constexpr, inv_k_scale=1.0, inv_v_scale=1.0, FP8: tl.constexpr = False,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    offs = tl.arange(0, BLOCK_HD)
    h = offs // HEAD_DIM
    d = offs % HEAD_DIM
    # padding slot (< 0): empty mask, nothing is read or written
    mask = offs < tl.where(slot >= 0, NUM_KV_HEADS * HEAD_DIM, 0)
    k = tl.load(key_ptr + i * stride_key_n + h * stride_key_h + d, mask=mask)
    v = tl.load(value_ptr + i * stride_value_n + h * stride_value_h + d, mask=mask)
    if FP8:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_LIMIT, FP8_LIMIT)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_LIMIT, FP8_LIMIT)
    tl.store(k_cache_ptr + blk * stride_kc_b + off * stride_kc_t + h * stride_kc_h + d,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_vc_b + off * stride_vc_t + h * stride_vc_h + d,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> None:
    """Write ``key``/``value[N, Hkv, D]`` into ``k_cache``/``v_cache`` at ``slot_mapping[N]``
    (an FP8 cache gets ``key / k_scale``, ``value / v_scale``)."""
    N, Hkv, D = key.shape
    if N == 0:
        return
    assert value.shape == key.shape, (value.shape, key.shape)
    assert slot_mapping.shape == (N,), (slot_mapping.shape, N)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (Hkv, D), (k_cache.shape, key.shape)
    assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head dim must be contiguous"
    block_size = k_cache.shape[1]
    hd = Hkv * D
    block_hd = triton.next_power_of_2(hd)
    num_warps = 4 if block_hd * key.element_size() >= 2048 else (2 if block_hd >= 256 else 1)
    _store_kvcache_kernel[(N,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_HD=block_hd,
        inv_k_scale=1.0 / k_scale, inv_v_scale=1.0 / v_scale, FP8=is_fp8(k_cache),
        num_warps=num_warps,
    )
