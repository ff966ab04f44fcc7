"""A linear layer with FP8 (e4m3) weights: per-output-channel weight scales, activations quantized
per token at run time (dynamic scales), vLLM's ``--quantization fp8`` on Hopper.

``y = (q(x) * sx) @ (W_q * sw)^T (+ bias)`` where ``q(x)`` rounds each token's row to e4m3 with
``sx = max|row| / 448`` and ``W_q``, ``sw`` are the stored weight and its ``[N, 1]`` scales. On
CUDA the product is one ``torch._scaled_mm`` (row-wise scales, fp32 accumulation, a bf16 result
cast to the activations' dtype); elsewhere the same numbers are computed by dequantizing both
operands and multiplying in fp32 (the reference and the CPU path). ``reduce``: applied to the product before
the bias (a row-parallel layer's all-reduce), None for a whole or column-parallel layer.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.common.layers.fused_dispatch import use_fused
from pdserve.common.ops.fp8 import FP8_DTYPE, per_row_scales, quantize_fp8

__all__ = ["Fp8Linear", "quantize_weight", "fp8_linear_ref"]


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[N, K]`` weight as (e4m3 ``[N, K]``, fp32 per-channel scales ``[N, 1]``)."""
    scale = per_row_scales(weight)
    return quantize_fp8(weight, scale), scale


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The dequantized product of ``x[M, K]`` (quantized per token here) and an e4m3 ``weight[N, K]``
    with scales ``[N, 1]``, computed in fp32, returned in x's dtype (no bias)."""
    x_scale = per_row_scales(x)
    xq = quantize_fp8(x, x_scale).float() * x_scale
    return (xq @ (weight.float() * weight_scale).t()).to(x.dtype)


def _quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 activations and their ``[M, 1]`` scales: one Triton launch where the fused
    kernels are on (ops/fp8_quant.py), else the torch reference."""
    if use_fused(x):
        from pdserve.common.ops.fp8_quant import quantize_rows  # imports Triton
        return quantize_rows(x)
    x_scale = per_row_scales(x)
    return quantize_fp8(x, x_scale), x_scale


def _scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale_t: torch.Tensor) -> torch.Tensor:
    """The CUDA product; row-wise scaled FP8 GEMMs write bf16 (then cast to x's dtype)."""
    xq, x_scale = _quantize_rows(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale_t, out_dtype=torch.bfloat16)
    return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


class Fp8Linear(nn.Module):
    """``weight``: e4m3 ``[N, K]`` (K and N multiples of 16 for the CUDA GEMM); ``weight_scale``:
    fp32 ``[N, 1]``; ``bias``: ``[N]`` in the activations' dtype or None."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8Linear: weight must be a 2-d {FP8_DTYPE} tensor, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        if tuple(weight_scale.shape) != (weight.shape[0], 1):
            raise ValueError(f"Fp8Linear: weight_scale must be [{weight.shape[0]}, 1], got {tuple(weight_scale.shape)}")
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale: torch.Tensor
        self.weight_scale_t: torch.Tensor                        # [1, N], as _scaled_mm takes it
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.register_buffer("weight_scale_t", weight_scale.float().reshape(1, -1).contiguous())
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = reduce

    @classmethod
    def from_linear(cls, linear: nn.Linear, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> Fp8Linear:
        """``linear``'s weight quantized per output channel (its bias kept)."""
        weight, scale = quantize_weight(linear.weight.detach())
        return cls(weight, scale, linear.bias, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if rows.is_cuda:
            y = _scaled_mm(rows.contiguous(), self.weight, self.weight_scale_t)
        else:
            y = fp8_linear_ref(rows, self.weight, self.weight_scale)
        return finish_rows(y, x, self.reduce, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def finish_rows(y: torch.Tensor, x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None,
                bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """A quantized projection's epilogue: ``reduce`` (a row-parallel all-reduce) before ``bias``,
    then ``y`` [rows, N] back to ``x``'s leading shape."""
    if reduce is not None:
        y = reduce(y)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], out_features)
