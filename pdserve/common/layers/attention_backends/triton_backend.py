"""The project's Triton kernels (pdserve/common/ops): the default backend on CUDA.

Decode takes the context's optional split-KV workspace and split count (CUDA graphs) and its
host-side max context length (eager split count).
"""
from __future__ import annotations

import torch

from pdserve.common.context import get_forward_context
from pdserve.common.layers.attention_backends.base import AttentionBackend


class TritonBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        from pdserve.common.ops import kv_store, paged_attention, paged_attention_prefill  # imports triton
        self._store = kv_store.store_kvcache
        self._decode = paged_attention.paged_attention_decode
        self._prefill = paged_attention_prefill.paged_attention_prefill

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        self._store(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)

    def prefill(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                max_seqlen_q, scale, out=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        return self._prefill(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, max_seqlen_q,
                             scale, out=out, k_scale=k_scale, v_scale=v_scale)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out=None, k_scale=1.0,
               v_scale=1.0) -> torch.Tensor:
        ctx = get_forward_context()
        return self._decode(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                            workspace=ctx.decode_workspace, num_splits=ctx.decode_num_splits,
                            max_context_len=ctx.max_context_len, pdl=ctx.pdl, k_scale=k_scale, v_scale=v_scale)
