"""The attention backend interface (shapes and conventions: ops/__init__.py).

``prefill`` runs after ``store_kv`` for the same tokens and reads the whole context through
``block_tables``; ``decode`` has one query per sequence and allocates nothing beyond its output
(CUDA-graph safe). ``out`` (optional, q's shape and dtype) receives and is returned the result.
``k_scale`` / ``v_scale``: the per-tensor scales of an FP8 cache (it holds ``K / k_scale``,
``V / v_scale``: ops/fp8.py); ignored for a cache of another dtype.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> None:
        """key/value: [N, Hkv, D]; slot_mapping: [N] int32."""

    @abstractmethod
    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, block_tables: torch.Tensor,
                max_seqlen_q: int, scale: float, out: torch.Tensor | None = None, k_scale: float = 1.0,
                v_scale: float = 1.0) -> torch.Tensor:
        """q: [T, Hq, D] -> out [T, Hq, D]."""

    @abstractmethod
    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               out: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """q: [B, Hq, D] -> out [B, Hq, D]."""
