"""A linear layer with block-scaled FP8 (e4m3) weights: one scale per ``tile_rows`` x 128 tile of
the weight (128x128, the scheme of DeepSeek-V3 and the Qwen3-*-FP8 checkpoints' ``weight_block_size:
[128, 128]`` as vLLM and SGLang run it on Hopper; or 1x128, one per output channel and 128-wide K
block), activations quantized at run time with one scale per 128 consecutive values of a token's
row (1x128 groups).

``y[m, n] = sum_kb (q(x)[m, kb] . W_q[n, kb]) * sx[m, kb] * sw[n // tile_rows, kb] (+ bias)``, kb
running over the 128-wide K blocks, ``q(x)`` rounding each group to e4m3 under ``sx = max|group| /
448``, the sums fp32: each block's partial is scaled by its two scales and accumulated, as the
block-scaled GEMM kernels do. A ragged last tile (K or N not a multiple of it) is scaled on its own
values. On CUDA (SM90, CUDA >= 12.9, K and N multiples of 128 with a K-block count that is a
multiple of 4, cuBLASLt's layout) the product is one ``torch._scaled_mm`` with 1x128 activation
scales and 128x128 or 1x128 weight scales, bf16 out; any other shape or device computes the same
sums in torch (the reference: fp32, per K block). ``reduce``: applied to the product before the bias (a row-parallel
layer's all-reduce), None for a whole or column-parallel layer.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pdserve.common.layers.fp8_linear import finish_rows
from pdserve.common.ops.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8

__all__ = ["BLOCK", "TILE_ROWS", "Fp8BlockLinear", "quantize_weight_blocks", "quantize_act_groups",
           "fp8_block_linear_ref", "blockwise_mm_supported"]

BLOCK = 128
TILE_ROWS = (BLOCK, 1)                      # a weight tile's rows: 128x128 or 1x128
_MIN_SCALE = 1e-12


def _tile_scales(t: torch.Tensor, rows: int) -> torch.Tensor:
    """fp32 scales mapping each ``rows`` x BLOCK tile's absolute maximum of ``t[R, C]`` to FP8_MAX:
    ``[ceil(R / rows), ceil(C / BLOCK)]``."""
    r, c = t.shape
    nr, nc = -(-r // rows), -(-c // BLOCK)
    a = t.abs().float()
    if (nr * rows, nc * BLOCK) != (r, c):
        a = torch.nn.functional.pad(a, (0, nc * BLOCK - c, 0, nr * rows - r))
    return (a.reshape(nr, rows, nc, BLOCK).amax(dim=(1, 3)) / FP8_MAX).clamp_(min=_MIN_SCALE)


def _expand(scale: torch.Tensor, rows: int, shape: torch.Size) -> torch.Tensor:
    """Tile scales ``[ceil(R / rows), ceil(C / BLOCK)]`` repeated over ``shape`` ``[R, C]``."""
    return scale.repeat_interleave(rows, 0)[:shape[0]].repeat_interleave(BLOCK, 1)[:, :shape[1]]


def quantize_weight_blocks(weight: torch.Tensor, tile_rows: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``[N, K]`` weight as (e4m3 ``[N, K]``, fp32 scales ``[ceil(N / tile_rows), ceil(K / 128)]``);
    with 128-row tiles, the layout of a checkpoint's ``weight_scale_inv``."""
    scale = _tile_scales(weight, tile_rows)
    return quantize_fp8(weight, _expand(scale, tile_rows, weight.shape)), scale


def quantize_act_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``[M, K]`` as (e4m3 ``[M, K]``, fp32 scales ``[M, ceil(K / 128)]``), one scale per
    token and 128-wide group."""
    scale = _tile_scales(x, 1)
    return quantize_fp8(x, _expand(scale, 1, x.shape)), scale


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The block-scaled product of ``x[M, K]`` (quantized in 1x128 groups here) and an e4m3
    ``weight[N, K]`` with tile scales ``[ceil(N / tile_rows), ceil(K / 128)]`` (tile_rows read off
    their shape): each K block's fp32 partial times its scales, summed in fp32; returned in x's
    dtype (no bias)."""
    xq, xs = quantize_act_groups(x)
    xq, w = xq.float(), weight.float()
    tile_rows = 1 if weight_scale.shape[0] == weight.shape[0] else BLOCK
    ws = weight_scale.float().repeat_interleave(tile_rows, 0)[:weight.shape[0]]       # [N, KB]
    y = torch.zeros(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for kb, k in enumerate(range(0, x.shape[1], BLOCK)):
        part = xq[:, k:k + BLOCK] @ w[:, k:k + BLOCK].t()
        y += part * xs[:, kb:kb + 1] * ws[:, kb]
    return y.to(x.dtype)


def _quantize_groups_cuda(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_act_groups for K a multiple of 128, the scales outer-dim-major (``[M, KB]`` with
    strides ``(1, M)``), as the block-scaled ``torch._scaled_mm`` takes them."""
    m, k = x.shape
    groups = x.reshape(m, k // BLOCK, BLOCK).float()
    scale = (groups.abs().amax(dim=-1) / FP8_MAX).clamp_(min=_MIN_SCALE)               # [M, KB]
    q = (groups / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(m, k)
    return q, scale.t().contiguous().t()


def blockwise_mm_supported(device: torch.device, n: int, k: int) -> bool:
    """Whether ``torch._scaled_mm`` takes 1x128 x 128x128 scales here: Hopper (SM90), CUDA >= 12.9,
    N and K multiples of 128 and a K-block count that is a multiple of 4."""
    if device.type != "cuda" or n % BLOCK or k % BLOCK or (k // BLOCK) % 4:
        return False
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


class Fp8BlockLinear(nn.Module):
    """``weight``: e4m3 ``[N, K]``; ``weight_scale``: fp32 ``[ceil(N / tile_rows), ceil(K / 128)]``
    (with 128-row tiles, a checkpoint's ``weight_scale_inv``); ``bias``: ``[N]`` in the activations'
    dtype or None. ValueError for another dtype, tile height or scale shape."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, tile_rows: int = BLOCK) -> None:
        super().__init__()
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise ValueError(f"Fp8BlockLinear: weight must be a 2-d {FP8_DTYPE} tensor, "
                             f"got {weight.dtype} {tuple(weight.shape)}")
        if tile_rows not in TILE_ROWS:
            raise ValueError(f"Fp8BlockLinear: tile_rows must be one of {TILE_ROWS}, got {tile_rows}")
        n, k = weight.shape
        blocks = (-(-n // tile_rows), -(-k // BLOCK))
        if tuple(weight_scale.shape) != blocks:
            raise ValueError(f"Fp8BlockLinear: weight_scale must be {list(blocks)} for a [{n}, {k}] weight, "
                             f"got {list(weight_scale.shape)}")
        self.out_features, self.in_features, self.tile_rows = n, k, tile_rows
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.weight_scale: torch.Tensor
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = reduce
        self._fused: bool | None = None             # blockwise_mm_supported, decided at the first call

    @classmethod
    def from_linear(cls, linear: nn.Linear, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    tile_rows: int = BLOCK) -> Fp8BlockLinear:
        """``linear``'s weight quantized in ``tile_rows`` x 128 tiles (its bias kept)."""
        weight, scale = quantize_weight_blocks(linear.weight.detach(), tile_rows)
        return cls(weight, scale, linear.bias, reduce, tile_rows)

    def _scaled_mm(self, rows: torch.Tensor) -> torch.Tensor:
        xq, xs = _quantize_groups_cuda(rows)
        # 128x128: scale_b.t() is [N / 128, KB] row-major; 1x128: [N, KB] outer-dim-major
        ws = self.weight_scale.t() if self.tile_rows == BLOCK else self.weight_scale.t().contiguous()
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16)
        return y if rows.dtype == torch.bfloat16 else y.to(rows.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features)
        if self._fused is None:
            self._fused = blockwise_mm_supported(rows.device, self.out_features, self.in_features)
        if self._fused:
            y = self._scaled_mm(rows.contiguous())
        else:
            y = fp8_block_linear_ref(rows, self.weight, self.weight_scale)
        return finish_rows(y, x, self.reduce, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"tile={self.tile_rows}x{BLOCK}")
