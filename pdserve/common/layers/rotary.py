"""Rotary position embedding (the "rotate half" convention of Llama / Qwen checkpoints)."""
from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor                                   # [max_position, head_dim] fp32 buffer
    sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)                      # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)               # [P, D]
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D]."""
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)   # [T, 1, D]
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
