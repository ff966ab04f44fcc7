"""Chunked-prefill scheduling: step composition (decode rows first, then chunks), the budget,
partial-prefill limits, no starvation, preemption of a partly prefilled sequence, prefix hits."""
from __future__ import annotations

import random

import pytest

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams

BS = 4


def make(num_blocks=64, max_num_seqs=8, budget=16, **kwargs):
    bm = BlockManager(num_blocks, BS)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=1024,
                          eos_token_ids=(2,), **kwargs)
    return Scheduler(cfg, bm), bm


def seq(n: int, start: int = 10, max_tokens: int = 32) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), BS)


def run_step(sched: Scheduler, token: int = 7) -> list[tuple[Sequence, int]]:
    """What the engine does with a step: KV computed, a token for each sequence that completes."""
    seqs, _ = sched.schedule()
    composition = [(s, s.num_scheduled_tokens) for s in seqs]
    for s in seqs:
        done = s.completes_in_step
        s.num_cached_tokens += s.num_scheduled_tokens
        if done:
            s.append_token(token)
    return composition


def test_config_rules():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64, eos_token_ids=())
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=64, eos_token_ids=(),
                        enable_chunked_prefill=False)
    SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, eos_token_ids=())


def test_long_prompt_is_chunked_under_the_budget():
    sched, bm = make(budget=16)
    a = seq(40)
    sched.add(a)
    assert run_step(sched) == [(a, 16)]
    assert a.num_cached_tokens == 16 and a.num_completion_tokens == 0     # no token mid-prompt
    assert len(a.block_table) == 10                                        # whole prompt allocated
    assert bm.num_cached_blocks == 4                                       # blocks of chunk 1 only
    assert run_step(sched) == [(a, 16)]
    assert run_step(sched) == [(a, 8)] and a.num_completion_tokens == 1   # last chunk: a token
    assert run_step(sched) == [(a, 1)]                                     # now a decode row


def test_decode_rows_first_then_running_chunk_then_waiting():
    sched, _ = make(budget=16)
    a, b = seq(3), seq(5, 100)
    sched.add(a), sched.add(b)
    assert run_step(sched) == [(a, 3), (b, 5)]
    c, d = seq(30, 200), seq(6, 300)
    sched.add(c), sched.add(d)
    # 2 decode rows (longest context first), then c's first chunk takes the rest: 16 - 2 = 14
    assert run_step(sched) == [(b, 1), (a, 1), (c, 14)]
    # d does not fit the 0 tokens left; next step: decode rows, c's next chunk, then d whole
    assert run_step(sched) == [(b, 1), (a, 1), (c, 14)]
    assert run_step(sched) == [(b, 1), (a, 1), (c, 2), (d, 6)]


def test_budget_and_max_num_seqs_never_exceeded():
    rng = random.Random(0)
    sched, bm = make(num_blocks=48, max_num_seqs=6, budget=12)
    for _ in range(400):
        if rng.random() < 0.3:
            sched.add(seq(rng.randint(1, 40), rng.randint(3, 900), max_tokens=rng.randint(1, 20)))
        decoding = {s.seq_id for s in sched.running if s.num_tokens - s.num_cached_tokens == 1}
        seqs, is_prefill = sched.schedule()
        assert sum(s.num_scheduled_tokens for s in seqs) <= 12 and len(seqs) <= 6
        decode = [s.seq_id in decoding for s in seqs]
        assert decode == sorted(decode, reverse=True)                     # decode rows first
        assert all(s.num_scheduled_tokens == 1 for s in seqs if s.seq_id in decoding)
        assert is_prefill == (not all(decode))
        for s in seqs:
            done = s.completes_in_step
            s.num_cached_tokens += s.num_scheduled_tokens
            if done:
                s.append_token(7)
                if s.num_completion_tokens >= s.sampling_params.max_tokens:
                    sched.finish(s, sched.stop_reason(s))
    assert sched.num_preemptions > 0


def test_one_partial_prefill_at_a_time_by_default():
    sched, _ = make(budget=16)
    a, b = seq(20), seq(20, 100)
    sched.add(a), sched.add(b)
    assert run_step(sched) == [(a, 16)]          # b would be a second partial prompt: it waits
    assert run_step(sched) == [(a, 4), (b, 12)]  # a finishes, so b may start as a chunk


def test_short_prompt_not_starved_behind_a_long_one_with_a_chunk_cap():
    sched, _ = make(budget=16, max_num_partial_prefills=2, long_prefill_token_threshold=8)
    long, short = seq(100), seq(6, 500)
    sched.add(long)
    assert run_step(sched) == [(long, 8)]        # capped at 8 even with 16 to spend
    sched.add(short)
    assert run_step(sched) == [(long, 8), (short, 6)]   # the short prompt goes in the same step
    assert short.num_completion_tokens == 1
    assert run_step(sched) == [(short, 1), (long, 8)]


def test_long_prompt_keeps_progressing_while_short_ones_keep_coming():
    sched, _ = make(budget=16, max_num_seqs=16)
    long = seq(64)
    sched.add(long)
    for i in range(4):
        sched.add(seq(3, 100 * (i + 1), max_tokens=2))
    steps = 0
    while long.num_completion_tokens == 0:
        sched.add(seq(3, 50 + steps, max_tokens=2))
        composition = dict((s.seq_id, n) for s, n in run_step(sched))
        assert composition.get(long.seq_id, 0) > 0    # an older prompt is never passed over
        steps += 1
        assert steps < 10


def test_partly_prefilled_sequence_is_preempted_for_a_decode_row_and_recomputed():
    sched, bm = make(num_blocks=7, budget=4, max_num_seqs=4)
    a = seq(4)
    sched.add(a)
    assert run_step(sched) == [(a, 4)]           # a: 1 block, its first token makes 5 tokens
    b = seq(20, 100)
    sched.add(b)
    assert run_step(sched) == [(a, 1), (b, 3)]   # a's row takes block 2; b all 5 others, chunk of 3
    assert bm.num_free_blocks == 0
    for _ in range(3):                           # a's tokens 6-8 start no block; b reaches 12 / 20
        assert run_step(sched) == [(a, 1), (b, 3)]
    assert run_step(sched) == [(a, 1)]           # a's 9th token needs a block: b gives its back
    assert b.status == SequenceStatus.WAITING and b.num_preemptions == 1 and not b.block_table
    assert b.num_cached_tokens == 0 and bm.num_cached_blocks >= 3      # its full blocks stay cached
    sched.finish(a, FinishReason.CANCELLED)      # room again: b is readmitted
    assert run_step(sched) == [(b, 4)]
    assert b.num_prefix_hit_tokens == 12         # the recompute starts after its cached chunks


def test_prefix_hit_skips_whole_blocks_before_chunking():
    sched, bm = make(budget=8)
    a = seq(17)
    sched.add(a)
    run_step(sched), run_step(sched), run_step(sched)
    assert a.num_completion_tokens == 1
    b = Sequence(a.prompt_token_ids[:16] + [999, 998, 997], SamplingParams(max_tokens=4), BS)
    sched.add(b)
    composition = run_step(sched)
    assert (b, 3) in composition and b.num_prefix_hit_tokens == 16     # 4 blocks hit, 3 tokens left


def test_a_step_with_decode_rows_has_the_mixed_budget_one_without_the_whole():
    with pytest.raises(ValueError, match="max_mixed_batched_tokens"):
        make(budget=16, max_mixed_batched_tokens=17)
    sched, _ = make(budget=16, max_mixed_batched_tokens=8)
    a, b = seq(40), seq(30, 200)
    sched.add(a)
    assert run_step(sched) == [(a, 16)]                 # no decode rows: the whole budget
    assert run_step(sched) == [(a, 16)]
    assert run_step(sched) == [(a, 8)]                  # a's last chunk: a is a decode row now
    sched.add(b)
    assert run_step(sched) == [(a, 1), (b, 7)]          # 8 - 1 decode row
    assert run_step(sched) == [(a, 1), (b, 7)]
