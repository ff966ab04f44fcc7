"""SiLU-and-multiply over a merged gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.common.layers.fused_dispatch import use_fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2*I] (gate then up) -> [T, I]."""
        if use_fused(x):
            from pdserve.common.ops.fused import silu_and_mul
            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
