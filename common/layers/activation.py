"""SiLU-and-multiply over a merged gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, 2*I] (gate then up) -> [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
