"""The reference backend: plain torch (gather through the block table, then SDPA).

The CPU production path and the oracle for the other backends.
"""
from __future__ import annotations

import torch

from pdserve.common.layers.attention_backends.base import AttentionBackend
from pdserve.common.ops.reference import paged_attention_decode_ref, paged_attention_prefill_ref, store_kvcache_ref


class TorchBackend(AttentionBackend):
    name = "torch"

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale=1.0, v_scale=1.0) -> None:
        store_kvcache_ref(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def prefill(self, q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables,
                max_seqlen_q, scale, out=None, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        return _into(out, paged_attention_prefill_ref(q, k_cache, v_cache, cu_seqlens_q, context_lens,
                                                      block_tables, max_seqlen_q, scale, k_scale, v_scale))

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale, out=None, k_scale=1.0,
               v_scale=1.0) -> torch.Tensor:
        return _into(out, paged_attention_decode_ref(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                     k_scale, v_scale))


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out
