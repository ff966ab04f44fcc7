"""FP8 (e4m3) quantization in plain torch: the KV cache's and the FP8 weights' number format.

A value ``x`` is stored as ``fp8(clamp(x / scale, -FP8_MAX, FP8_MAX))`` and read back as
``float(stored) * scale``; ``scale`` is a positive float (a per-tensor scale) or a tensor that
broadcasts against ``x`` (per-channel, per-token, per-block). Values beyond the range saturate
instead of becoming NaN (e4m3fn has no infinity). Any device.
"""
from __future__ import annotations

import torch

__all__ = ["FP8_DTYPE", "FP8_MAX", "is_fp8", "quantize_fp8", "dequantize_fp8", "per_row_scales"]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)       # 448
_MIN_SCALE = 1e-12                                # an all-zero row keeps a usable scale


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``x / scale`` rounded to e4m3 (saturated at +-FP8_MAX); computed in fp32 (one temporary)."""
    y = x.to(torch.float32, copy=True)
    return y.div_(scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x: torch.Tensor, scale: float | torch.Tensor = 1.0,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float(x) * scale`` in ``dtype``; ``x`` of any dtype (a non-FP8 tensor is just scaled)."""
    return (x.float() * scale).to(dtype)


def per_row_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, 1]`` scales mapping each row's absolute maximum of ``x[rows, cols]`` to
    FP8_MAX (the per-channel weight scales and the dynamic per-token activation scales)."""
    return (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
