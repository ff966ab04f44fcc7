"""The attention backend interface.

Rules every backend follows:
- ``store_kv`` writes the new tokens' K/V into the paged cache at ``slot_mapping``; a negative
  slot is padding and is skipped.
- ``prefill`` runs after ``store_kv`` for the same tokens and reads K/V for the whole context
  (cached prefix + new tokens) from the cache through ``block_tables``; causal with an offset:
  query ``i`` of sequence ``b`` sits at position ``context_lens[b] - q_len_b + i``.
- ``decode`` has exactly one query per sequence, at position ``context_lens[b] - 1``.
- K/V caches are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views with an arbitrary
  block stride (see docs/design.md, "KV cache layout"); the inner three dims are contiguous.
- No backend allocates in ``decode`` beyond its output, so that it can run inside a CUDA graph.
- ``out`` (optional, q's shape and dtype, last dim contiguous): where to write the result; it is
  also returned. A mixed step writes its decode rows and its prompt chunks into one tensor.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value: [N, Hkv, D]; slot_mapping: [N] int32."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                max_seqlen_q: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D]."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [B, Hq, D] -> out [B, Hq, D]."""
