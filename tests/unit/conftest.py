"""Unit tests run on the CPU: Triton kernels go through its interpreter there.

TRITON_INTERPRET must be set before Triton is first imported, so it is set here, for every
unit-test module, and only when no CUDA device is present.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
