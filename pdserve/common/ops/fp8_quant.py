"""Triton kernel quantizing activations to e4m3 per row (dynamic per-token scales) in one launch:
``scale[r] = max(max|x[r]| / 448, 1e-12)``, ``q[r] = fp8(clamp(x[r] / scale[r], +-448))``, as
ops/fp8.py's ``per_row_scales`` and ``quantize_fp8`` compute them (the reference). Two passes over
a row (its max, then the quantized values). No host sync, no allocation given the outputs:
CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.ops.fp8 import FP8_DTYPE
from pdserve.common.ops.kv_store import FP8_LIMIT

__all__ = ["quantize_rows"]

_MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, n_cols, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for c0 in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row * stride_x + c0 + offs, mask=c0 + offs < n_cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, 0) / FP8_LIMIT, _MIN_SCALE)
    for c0 in range(0, n_cols, BLOCK):
        mask = c0 + offs < n_cols
        x = tl.load(x_ptr + row * stride_x + c0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_LIMIT, FP8_LIMIT)
        tl.store(q_ptr + row * stride_q + c0 + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x[M, K]`` (last dim contiguous) -> (e4m3 ``[M, K]``, fp32 scales ``[M, 1]``)."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = min(4096, triton.next_power_of_2(K))
        _quantize_rows_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    return q, scale


