"""Programmatic dependent launch (PDL) for the project's Triton kernels.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream
still runs; it must call ``gdc_wait()`` before it reads anything that kernel (or an earlier one)
wrote, and before it writes anything. ``gdc_launch_dependents()`` lets the next such kernel start.
Needs compute capability 9.0 or newer and a Triton that has ``tl.extra.cuda.gdc_wait``.
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def pdl_available(device: torch.device) -> bool:
    """PDL on this device: CUDA (not the interpreter), compute capability 9.0+, a Triton with it."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    import triton.language as tl
    return hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")


def launch_args(pdl: bool) -> dict:
    """Extra launch arguments of a kernel with a ``PDL`` constexpr: PDL on, or nothing."""
    return {"PDL": True, "launch_pdl": True} if pdl else {}
