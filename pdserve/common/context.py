"""The per-forward context: what attention layers need to know about the current batch. Set for
exactly one forward by ``forward_context(...)`` (always reset, also on an exception). A prefill
step's first ``num_decode_tokens`` rows decode one token each; the rest are prompt chunks.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class ForwardContext:
    is_prefill: bool
    slot_mapping: torch.Tensor            # [num_tokens] int32: where each new token's KV goes
    context_lens: torch.Tensor            # [B] int32: tokens of context incl. the new ones
    block_tables: torch.Tensor            # [B, max_blocks] int32, padded with -1
    cu_seqlens_q: torch.Tensor | None = None   # [Bp+1] int32 (prefill): the prompt-chunk rows only
    num_decode_tokens: int = 0                 # prefill steps: leading rows that decode one token each
    chunk_context_lens: torch.Tensor | None = None   # [Bp] int32: context_lens of the chunk rows (mixed)
    chunk_block_tables: torch.Tensor | None = None   # [Bp, max_blocks] int32: their block tables (mixed)
    max_seqlen_q: int = 1
    max_context_len: int | None = None         # host-side max of context_lens, when known
    decode_workspace: torch.Tensor | None = None   # preallocated split-KV workspace (CUDA graphs)
    decode_num_splits: int | None = None       # fixed split count (CUDA graphs)
    pdl: bool = False                          # decode kernels launched with programmatic dependent launch
                                               # (set by the decode chain, models/dataflow_decode.py)


_current: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward context is set: run the model inside forward_context(...)")
    return _current


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    previous, _current = _current, ctx
    try:
        yield ctx
    finally:
        _current = previous
