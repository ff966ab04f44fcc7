"""Pure-torch references for the paged-attention ops (docs/design.md, "Attention ops").

Any device and floating dtype; computed in fp32, returned in the query's dtype. The oracle for
the Triton kernels and the CPU path of the "torch" backend. They synchronize with the GPU
(fine for a reference); a sequence with ``context_lens`` 0 gets zeros. An FP8 cache holds
``K / k_scale`` and ``V / v_scale`` (per-tensor scales, ops/fp8.py); a cache of another dtype
holds K and V as they are (its scales are 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.common.ops.fp8 import is_fp8, quantize_fp8

__all__ = ["store_kvcache_ref", "paged_attention_decode_ref", "paged_attention_prefill_ref"]


def store_kvcache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> None:
    """Write ``key``/``value`` ``[N, Hkv, D]`` into ``[num_blocks, block_size, Hkv, D]`` caches
    at ``slot_mapping[N]`` (in place; an FP8 cache gets them divided by ``k_scale``/``v_scale``);
    negative slots are skipped."""
    block_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.long)
    valid = slots >= 0
    if not bool(valid.all()):
        slots = slots[valid]
        key = key[valid]
        value = value[valid]
    if slots.numel() == 0:
        return
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots % block_size
    if is_fp8(k_cache):
        key, value = quantize_fp8(key, k_scale), quantize_fp8(value, v_scale)
    k_cache[blocks, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, offsets] = value.to(v_cache.dtype)


def _scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a read multiplies by: the given ones for an FP8 cache, else 1."""
    return (k_scale, v_scale) if is_fp8(k_cache) else (1.0, 1.0)


def paged_attention_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query per sequence: ``q[B, Hq, D]`` attends to keys ``0..context_lens[b]-1``; returns
    ``out[B, Hq, D]`` in q's dtype."""
    B, Hq, D = q.shape
    if B == 0:
        return torch.empty_like(q)
    _, block_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    bt = block_tables.to(torch.long).clamp(min=0)                   # [B, MB]
    n_tok = bt.shape[1] * block_size
    ks, vs = _scales(k_cache, k_scale, v_scale)
    k = k_cache[bt].reshape(B, n_tok, Hkv, D).float() * ks          # [B, N, Hkv, D]
    v = v_cache[bt].reshape(B, n_tok, Hkv, D).float() * vs
    qf = q.float().reshape(B, Hkv, G, D)
    scores = torch.matmul(qf, k.permute(0, 2, 3, 1)) * scale        # [B, Hkv, G, N]
    lens = context_lens.to(device=q.device, dtype=torch.long)
    visible = torch.arange(n_tok, device=q.device)[None, :] < lens[:, None]   # [B, N]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))                # [B, Hkv, G, D]
    out = torch.where((lens > 0)[:, None, None, None], out, torch.zeros((), device=q.device))
    return out.reshape(B, Hq, D).to(q.dtype)


def paged_attention_prefill_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                                block_tables: torch.Tensor, max_seqlen_q: int,
                                scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Varlen prefill, causal with offset: query ``i`` of sequence ``b`` (``q[T, Hq, D]``, split by
    ``cu_seqlens_q[B+1]``) sits at ``context_lens[b] - q_len_b + i``; returns ``out[T, Hq, D]``."""
    del max_seqlen_q
    T, Hq, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    ks, vs = _scales(k_cache, k_scale, v_scale)
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    for b in range(len(lens)):
        start, end, L = cu[b], cu[b + 1], lens[b]
        q_len = end - start
        if q_len == 0 or L == 0:
            continue
        if L < q_len:
            raise ValueError(f"sequence {b}: context_lens {L} < query length {q_len}")
        n_blocks = -(-L // block_size)
        blocks = block_tables[b, :n_blocks].to(torch.long)
        k = k_cache[blocks].reshape(n_blocks * block_size, Hkv, D)[:L].float() * ks
        v = v_cache[blocks].reshape(n_blocks * block_size, Hkv, D)[:L].float() * vs
        # GQA without repeating K/V: fold the G query heads of a KV head into the query axis.
        qb = q[start:end].float().reshape(q_len, Hkv, G, D).permute(1, 2, 0, 3)
        qb = qb.reshape(Hkv, G * q_len, D)
        pos = (L - q_len) + torch.arange(q_len, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= pos[:, None]         # [q_len, L]
        ob = F.scaled_dot_product_attention(qb, k.permute(1, 0, 2), v.permute(1, 0, 2),
                                            attn_mask=mask.repeat(G, 1), scale=scale)
        ob = ob.reshape(Hkv, G, q_len, D).permute(2, 0, 1, 3).reshape(q_len, Hq, D)
        out[start:end] = ob.to(q.dtype)
    return out
