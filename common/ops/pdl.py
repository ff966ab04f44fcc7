"""Programmatic dependent launch (PDL) for the Triton kernels of the decode step.

On Hopper and newer GPUs a kernel launched with PDL may be scheduled while the kernel before it
on the stream is still finishing; it then waits in ``gdc_wait()`` (its first statement) until
that kernel's writes are visible. The launch and ramp-up of each small kernel thus overlap the
tail of the previous one. Each kernel that takes part has a ``USE_PDL: tl.constexpr`` argument
and starts with ``if USE_PDL: tl.extra.cuda.gdc_wait()``; callers pass ``**pdl_args(tensor)``.
Off on CPU, under the Triton interpreter, before compute capability 9.0, or with
``PDSERVE_PDL=0``.
"""
from __future__ import annotations

import functools
import os

import torch

from common import env


@functools.lru_cache(maxsize=8)
def _enabled(device_index: int) -> bool:
    if not env.pdl() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_args(t: torch.Tensor) -> dict:
    """Keyword arguments of a Triton launch: ``USE_PDL`` and, when on, ``launch_pdl``."""
    if t.device.type != "cuda" or not _enabled(t.device.index if t.device.index is not None
                                               else torch.cuda.current_device()):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}
