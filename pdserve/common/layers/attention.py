"""Paged self-attention over the current forward context, through a pluggable backend."""
from __future__ import annotations

import torch
from torch import nn

from pdserve.common.context import ForwardContext, get_forward_context
from pdserve.common.layers.attention_backends import get_backend


class PagedAttention(nn.Module):
    """Stores the new tokens' K/V into this layer's paged cache, then attends; ``k_cache`` /
    ``v_cache`` (``[num_blocks, block_size, Hkv, D]`` views) are bound by the ModelRunner, with
    ``k_scale`` / ``v_scale``, the per-tensor scales of an FP8 cache (1.0 unless the checkpoint
    carries them; unused for a cache in the model's dtype)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str = "torch") -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        self.backend = get_backend(backend)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_stored: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] -> [T, Hq, D]. ``kv_stored``: the caller already
        wrote k/v into the cache at the context's slots (the fused qk-norm+RoPE kernel does).
        ``out``: a [T, Hq, D] tensor a decode step writes into (returned), else a new one."""
        ctx = get_forward_context()
        if self.k_cache.numel() == 0:
            raise RuntimeError("KV cache is not allocated")
        if out is not None and ctx.is_prefill:
            raise ValueError("PagedAttention: out= is for decode steps only")
        ks, vs = self.k_scale, self.v_scale
        if not kv_stored:
            self.backend.store_kv(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, k_scale=ks, v_scale=vs)
        if not ctx.is_prefill:
            return self.backend.decode(q, self.k_cache, self.v_cache, ctx.block_tables,
                                       ctx.context_lens, self.scale, out=out, k_scale=ks, v_scale=vs)
        nd = ctx.num_decode_tokens
        if nd == 0:
            return self.backend.prefill(q, self.k_cache, self.v_cache, _cu_seqlens_q(ctx),
                                        ctx.context_lens, ctx.block_tables, ctx.max_seqlen_q, self.scale,
                                        k_scale=ks, v_scale=vs)
        # a mixed step: decode rows first, then prompt chunks, each through its own kernel
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        self.backend.decode(q[:nd], self.k_cache, self.v_cache, ctx.block_tables[:nd],
                            ctx.context_lens[:nd], self.scale, out=out[:nd], k_scale=ks, v_scale=vs)
        if q.shape[0] > nd:
            lens = ctx.chunk_context_lens if ctx.chunk_context_lens is not None else ctx.context_lens[nd:]
            tables = ctx.chunk_block_tables if ctx.chunk_block_tables is not None else ctx.block_tables[nd:]
            self.backend.prefill(q[nd:], self.k_cache, self.v_cache, _cu_seqlens_q(ctx), lens, tables,
                                 ctx.max_seqlen_q, self.scale, out=out[nd:], k_scale=ks, v_scale=vs)
        return out


def _cu_seqlens_q(ctx: ForwardContext) -> torch.Tensor:
    """The prompt-chunk rows' cumulative query lengths: set on every step that has chunk rows."""
    if ctx.cu_seqlens_q is None:
        raise RuntimeError("forward context has prompt-chunk rows but no cu_seqlens_q")
    return ctx.cu_seqlens_q
