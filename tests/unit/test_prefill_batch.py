"""The vectorized prefill arrays against the per-token definition, hand-computed cases first."""
from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.common.engine.prefill_batch import prefill_batch
from pdserve.common.engine.sequence import Sequence
from pdserve.common.sampling_params import SamplingParams


def _seq(tokens: list[int], blocks: list[int], cached: int, scheduled: int, block_size: int) -> Sequence:
    s = Sequence(tokens, SamplingParams(), block_size)
    s.block_table, s.num_cached_tokens, s.num_scheduled_tokens = list(blocks), cached, scheduled
    return s


def test_hand_computed_mixed_step():
    """One decode row (token 5 of 6, blocks [7, 2]) and a chunk (tokens 1..3 of 4, blocks [4]);
    block size 4."""
    dec = _seq([10, 11, 12, 13, 14, 15], [7, 2], cached=5, scheduled=1, block_size=4)
    chunk = _seq([20, 21, 22, 23], [4], cached=1, scheduled=3, block_size=4)
    b = prefill_batch([dec, chunk], 4, num_decode=1)
    assert b.input_ids.tolist() == [15, 21, 22, 23]
    assert b.positions.tolist() == [5, 1, 2, 3]
    assert b.slot_mapping.tolist() == [2 * 4 + 1, 4 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3]
    assert b.context_lens.tolist() == [6, 4]
    assert b.cu_seqlens_q.tolist() == [0, 3] and b.max_seqlen_q == 3
    assert b.block_tables.tolist() == [[7, 2], [4, -1]]
    assert (b.input_ids.dtype, b.positions.dtype, b.slot_mapping.dtype) == (np.int64, np.int64, np.int32)


def _per_token(seqs: list[Sequence], block_size: int, nd: int) -> dict:
    """The definition, one token at a time."""
    ids, pos, slots, cu = [], [], [], [0]
    for i, s in enumerate(seqs):
        start, end = s.num_cached_tokens, s.num_cached_tokens + s.num_scheduled_tokens
        for p in range(start, end):
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(s.block_table[p // block_size] * block_size + p % block_size)
        if i >= nd:
            cu.append(cu[-1] + end - start)
    return {"input_ids": ids, "positions": pos, "slot_mapping": slots, "cu_seqlens_q": cu,
            "context_lens": [s.num_cached_tokens + s.num_scheduled_tokens for s in seqs]}


@pytest.mark.parametrize("seed", range(5))
def test_random_steps_match_the_per_token_definition(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 16, 256])
    nd = rng.randint(0, 6)
    seqs = []
    for i in range(nd + rng.randint(1, 8)):
        n = rng.randint(1, 700)
        cached = n - 1 if i < nd else rng.randint(0, n - 1)
        scheduled = 1 if i < nd else rng.randint(1, n - cached)
        blocks = rng.sample(range(10_000), -(-n // bs))
        seqs.append(_seq([rng.randrange(150_000) for _ in range(n)], blocks, cached, scheduled, bs))
    got = prefill_batch(seqs, bs, nd)
    want = _per_token(seqs, bs, nd)
    for name, values in want.items():
        assert getattr(got, name).tolist() == values, name
    width = max(len(s.block_table) for s in seqs)
    assert got.block_tables.tolist() == [s.block_table + [-1] * (width - len(s.block_table)) for s in seqs]
    assert got.max_seqlen_q == max(s.num_scheduled_tokens for s in seqs[nd:])
    assert [a.dtype for a in (got.input_ids, got.positions, got.slot_mapping, got.context_lens, got.cu_seqlens_q,
                              got.block_tables)] == [np.int64, np.int64, np.int32, np.int32, np.int32, np.int32]


def test_no_prompt_rows():
    """Every row a decode row: an empty cu_seqlens_q tail, max_seqlen_q 0."""
    seqs = [_seq([1, 2, 3], [0], cached=2, scheduled=1, block_size=4) for _ in range(3)]
    b = prefill_batch(seqs, 4, num_decode=3)
    assert b.cu_seqlens_q.tolist() == [0] and b.max_seqlen_q == 0 and b.input_ids.tolist() == [3, 3, 3]


def test_too_few_blocks_and_empty_steps_are_refused():
    """A sequence whose table is too short for its positions (another sequence's longer table pads
    the array with -1) raises instead of producing negative slots; so does an empty step."""
    short = _seq(list(range(8)), [5], cached=0, scheduled=8, block_size=4)
    long = _seq(list(range(8)), [1, 2], cached=0, scheduled=8, block_size=4)
    with pytest.raises(RuntimeError, match="blocks"):
        prefill_batch([long, short], 4, num_decode=0)
    with pytest.raises(ValueError, match="at least one"):
        prefill_batch([], 4, num_decode=0)
