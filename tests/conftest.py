"""Shared pytest setup: the repository root on sys.path; Triton's interpreter on CPU machines.

TRITON_INTERPRET must be set before Triton is first imported (any test module may import it
while being collected), so it is set here, at the root, and only when no CUDA device is present.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
