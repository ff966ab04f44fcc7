"""Rotary position embedding (the "rotate half" convention of Llama / Qwen checkpoints), with
Llama 3's frequency scaling where the checkpoint asks for it (``rope_type: llama3``)."""
from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.common.config import RopeScaling


def default_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """The ``head_dim / 2`` fp32 inverse frequencies ``base ** (-2i / head_dim)``."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """``inv_freq`` scaled by Llama 3's rule (the formula of transformers' llama3 rope type).

    With ``L = original_max_position_embeddings`` and wavelength ``w = 2 pi / f``: a frequency
    with ``w < L / high_freq_factor`` is kept; one with ``w > L / low_freq_factor`` is divided by
    ``factor``; one between becomes ``(1 - s) f / factor + s f`` with
    ``s = (L / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor                                   # [max_position, head_dim] fp32 buffer
    sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: RopeScaling | None = None) -> None:
        """cos / sin of positions ``0 .. max_position - 1``; ``scaling`` (None = none) rescales
        the inverse frequencies first (``llama3_inv_freq``)."""
        super().__init__()
        inv_freq = default_inv_freq(head_dim, base)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
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
