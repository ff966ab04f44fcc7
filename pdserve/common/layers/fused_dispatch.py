"""Whether a layer takes the fused Triton path: CUDA tensors, Triton importable, not disabled.

The torch code of each layer stays the reference (and the CPU path, where HF parity is exact).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from pdserve.common import env


@functools.lru_cache(maxsize=1)
def _available() -> bool:
    return env.fused_ops() and importlib.util.find_spec("triton") is not None


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _available()
