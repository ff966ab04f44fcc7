"""The flat host arrays of a step with prompt tokens, built with numpy.

A prefill (or mixed) step computes tokens ``[num_cached_tokens, num_cached_tokens +
num_scheduled_tokens)`` of each Sequence; the model takes them as one flat row list. Building
that list token by token in Python cost the host ~8 ms for a 16k-token W-nano step on the H100
machine, while the GPU waited for the step's launches (bench/NOTES.md run 41); here every
per-token array comes from a few vectorized numpy operations over the per-sequence counts.

Rules:
- rows follow ``seqs`` order; sequence ``i`` owns rows ``[first_row[i], first_row[i] + count[i])``;
- ``slot = block_table[pos // block_size] * block_size + pos % block_size`` for every row;
- ``cu_seqlens_q`` covers the sequences from ``num_decode`` on (the prompt-chunk rows), starting at 0;
- ``block_tables`` is ``[B, max blocks]``, padded with -1.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from pdserve.common.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefillBatch:
    """The host arrays of one step (the module docstring has the rules)."""

    input_ids: np.ndarray       # [T] int64
    positions: np.ndarray       # [T] int64
    slot_mapping: np.ndarray    # [T] int32
    context_lens: np.ndarray    # [B] int32: tokens in the cache after the step
    cu_seqlens_q: np.ndarray    # [B - num_decode + 1] int32
    block_tables: np.ndarray    # [B, W] int32, -1 padded

    @property
    def max_seqlen_q(self) -> int:
        return int(np.diff(self.cu_seqlens_q).max(initial=0))


def block_table_array(seqs: list[Sequence]) -> np.ndarray:
    """[B, max blocks] int32, -1 padded (B >= 1)."""
    if not seqs:
        raise ValueError("a step needs at least one sequence")
    width = max(len(s.block_table) for s in seqs)
    table = np.full((len(seqs), width), -1, dtype=np.int32)
    for i, s in enumerate(seqs):
        table[i, :len(s.block_table)] = s.block_table
    return table


def prefill_batch(seqs: list[Sequence], block_size: int, num_decode: int) -> PrefillBatch:
    """The step's flat arrays; ``num_decode`` leading sequences are decode rows (one token each)."""
    n = len(seqs)
    starts = np.fromiter((s.num_cached_tokens for s in seqs), dtype=np.int64, count=n)
    counts = np.fromiter((s.num_scheduled_tokens for s in seqs), dtype=np.int64, count=n)
    ends = starts + counts
    total = int(counts.sum())
    spans = zip(seqs, starts.tolist(), ends.tolist())
    input_ids = np.fromiter(itertools.chain.from_iterable(s.token_ids[a:b] for s, a, b in spans),
                            dtype=np.int64, count=total)
    owner = np.repeat(np.arange(n), counts)                         # [T] the sequence of each row
    first_row = np.cumsum(counts) - counts                          # [B]
    positions = np.arange(total, dtype=np.int64) - first_row[owner] + starts[owner]
    tables = block_table_array(seqs)
    blocks = tables[owner, positions // block_size]                 # [T]; -1: past a sequence's table
    if total and blocks.min() < 0:
        bad = seqs[int(owner[int(np.argmin(blocks))])]
        raise RuntimeError(f"{bad!r}: positions up to {bad.num_cached_tokens + bad.num_scheduled_tokens} "
                           f"need more than its {len(bad.block_table)} blocks of {block_size}")
    slots = blocks.astype(np.int64) * block_size + positions % block_size
    cu_q = np.zeros(n - num_decode + 1, dtype=np.int32)
    cu_q[1:] = np.cumsum(counts[num_decode:])
    return PrefillBatch(input_ids=input_ids, positions=positions, slot_mapping=slots.astype(np.int32),
                        context_lens=ends.astype(np.int32), cu_seqlens_q=cu_q, block_tables=tables)
