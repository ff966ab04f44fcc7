"""One prefill, n samples: a request's sequence forks into ``SamplingParams.n`` sequences.

Sample 0 is the sequence added; when its first token is appended (its prompt's KV is computed or
has landed from a prefill worker) it forks, before anything else looks at that token, into
samples 1..n-1 (:func:`fork`). Each fork holds the prompt's tokens with ``num_cached_tokens =
num_prompt_tokens - 1``: it shares sample 0's blocks before the one holding the prompt's last
token (one more reference each, BlockManager.fork) and owns a copy of that block (copy on write:
``ModelRunner.copy_blocks``, enqueued after the steps that wrote it), so its first step is a
decode row that recomputes the last prompt position into its own block and samples its first
token with its own parameters (``SamplingParams.for_sample``: ``seed + index``). No prompt token
is prefilled twice; the forks' blocks were taken with sample 0's at admission
(``Sequence.fork_block_ids``), so a fork never waits for room.

After the fork each sample is an ordinary sequence: it decodes, is preempted (and recomputed
from the prefix cache), finishes and frees exactly its own blocks; the request ends when every
sample has (``Sequence.all_samples_finished``).
"""
from __future__ import annotations

from typing import Protocol

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.guided.state import GuideCompiler


class ForkEngine(Protocol):
    """What a fork uses of its engine (``LLMEngine`` is one)."""

    block_manager: BlockManager
    scheduler: Scheduler
    model_runner: ModelRunner
    guides: GuideCompiler


def fork(engine: ForkEngine, seq: Sequence) -> list[Sequence]:
    """Fork sample 0 ``seq`` (``seq.num_forks`` > 0, its first token just appended, its blocks
    held) into its other samples, which join the running batch; returns them."""
    assert seq.num_forks and seq.num_completion_tokens >= 1 and seq.block_table, seq
    forks = [_new_sample(engine, seq, i) for i in range(1, seq.sampling_params.n)]
    pairs = [engine.block_manager.fork(seq, child) for child in forks]
    engine.model_runner.copy_blocks(pairs)
    seq.forked = True
    for child in forks:
        child.num_cached_tokens = child.num_tokens - 1
        child.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(child)
    return forks


def _new_sample(engine: ForkEngine, seq: Sequence, index: int) -> Sequence:
    child = Sequence(seq.prompt_token_ids, seq.sampling_params.for_sample(index), seq.block_size,
                     seq.request_id)
    child.index = index
    child.samples = seq.samples
    seq.samples.append(child)
    child.tpot_slo_ms = seq.tpot_slo_ms
    child.num_prefix_hit_tokens = seq.num_prefix_hit_tokens
    if child.sampling_params.guide is not None:
        child.guide = engine.guides.new_state(child.sampling_params.guide)
    return child
