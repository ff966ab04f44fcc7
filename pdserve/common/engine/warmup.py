"""A warm-up step before the first request (CUDA), so that every Triton kernel variant the
engine launches is compiled before serving (chosen by measurement: bench/NOTES.md). It runs a
prefill, a sampled and a greedy decode and a mixed step of two multi-block sequences on free
blocks, with no block-manager bookkeeping: nothing is allocated, registered or counted.
"""
from __future__ import annotations

import logging
import time

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.sequence import Sequence
from pdserve.common.hashing import NO_PARENT
from pdserve.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def scratch_blocks(block_manager: BlockManager, limit: int = 64) -> list[int]:
    """Free blocks whose content nobody can hit in the prefix cache (safe to overwrite)."""
    out = []
    for block_id in block_manager.free_block_ids:
        if block_manager.blocks[block_id].hash == NO_PARENT:
            out.append(block_id)
            if len(out) == limit:
                break
    return out


def warm_up(runner: ModelRunner, free_block_ids: list[int], max_model_len: int) -> None:
    """Prefill + decode of two multi-block sequences on ``free_block_ids`` (see
    ``scratch_blocks``; they stay free)."""
    bs = runner.block_size
    length = min(2 * bs + 3, max_model_len - 4)            # more than one block: a real block table
    blocks_per_seq = -(-(length + 3) // bs)
    if length < 1 or len(free_block_ids) < 2 * blocks_per_seq:
        return
    start = time.perf_counter()
    vocab = runner.model_config.vocab_size
    params = (SamplingParams(temperature=0.7, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence([(7 * i + j) % vocab for j in range(length - i)], p, bs)
        seq.block_table = free_block_ids[i * blocks_per_seq:(i + 1) * blocks_per_seq]
        seqs.append(seq)
    for seq in seqs:
        seq.num_scheduled_tokens = seq.num_tokens
    tokens, _ = runner.run(seqs, True)
    for _ in range(2):
        for seq, t in zip(seqs, tokens):
            seq.num_cached_tokens = seq.num_tokens
            seq.append_token(t)
            seq.num_scheduled_tokens = 1
        tokens, _ = runner.run(seqs, False)
    # a mixed step (chunked prefill): row 0 decodes, row 1 recomputes its last few tokens
    seqs[0].num_cached_tokens = seqs[0].num_tokens
    seqs[0].append_token(tokens[0])
    seqs[1].num_cached_tokens = seqs[1].num_tokens - 3
    seqs[1].num_scheduled_tokens = 3
    runner.run(seqs, True)
    for seq in seqs:
        seq.block_table = []
        runner.release(seq)
    logger.info("warm-up (kernel compilation) took %.2f s", time.perf_counter() - start)
