"""Scheduler without chunked prefill (whole-prompt steps, prefill first): admission limits,
preemption of the newest, recompute. Chunked steps: test_scheduler_chunked.py."""
from __future__ import annotations

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams

BS = 4


def make(num_blocks=16, max_num_seqs=8, max_tokens=64):
    bm = BlockManager(num_blocks, BS)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                          max_model_len=max_tokens, eos_token_ids=(2,), enable_chunked_prefill=False)
    return Scheduler(cfg, bm), bm


def seq(n: int, start: int = 10, max_tokens: int = 32) -> Sequence:
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), BS)


def decode_one(sched: Scheduler, seqs: list[Sequence], token: int = 7) -> None:
    """What the engine does after a step: KV computed, one token appended."""
    for s in seqs:
        s.num_cached_tokens = s.num_tokens
        s.append_token(token)


def test_prefill_respects_token_budget_and_max_seqs():
    sched, bm = make(max_num_seqs=2, max_tokens=20)
    a, b, c = seq(8), seq(8, 100), seq(8, 200)
    for s in (a, b, c):
        sched.add(s)
    scheduled, is_prefill = sched.schedule()
    assert is_prefill and scheduled == [a, b]          # c: max_num_seqs reached
    assert list(sched.waiting) == [c] and all(s.status == SequenceStatus.RUNNING for s in (a, b))
    sched2, _ = make(max_num_seqs=8, max_tokens=20)
    x, y = seq(12), seq(12, 100)
    sched2.add(x), sched2.add(y)
    scheduled, _ = sched2.schedule()
    assert scheduled == [x]                            # 24 tokens > budget of 20


def test_prefill_first_then_decode():
    sched, bm = make()
    a = seq(5)
    sched.add(a)
    assert sched.schedule() == ([a], True)
    decode_one(sched, [a])
    b = seq(3, 100)
    sched.add(b)
    assert sched.schedule() == ([b], True)             # a waits while b prefills
    decode_one(sched, [b])
    scheduled, is_prefill = sched.schedule()
    assert not is_prefill and scheduled == [a, b]


def test_decode_preempts_newest_and_recomputes():
    sched, bm = make(num_blocks=4)
    a, b = seq(4), seq(4, 100)                          # one full block each
    sched.add(a), sched.add(b)
    assert sched.schedule()[0] == [a, b]
    decode_one(sched, [a, b])                          # both need a 2nd block now: 2 free, ok
    assert sched.schedule() == ([a, b], False)
    assert bm.num_free_blocks == 0
    for _ in range(3):                                 # fill the 2nd blocks (tokens 5..8)
        decode_one(sched, [a, b])
        assert sched.schedule() == ([a, b], False)
    decode_one(sched, [a, b])                          # 9th token: both need a 3rd block, none free
    scheduled, is_prefill = sched.schedule()
    assert not is_prefill and scheduled == [a]
    assert b.status == SequenceStatus.WAITING and list(sched.waiting) == [b]
    assert b.block_table == [] and b.num_cached_tokens == 0 and b.num_preemptions == 1
    assert sched.num_preemptions == 1 and a.num_tokens == 9 and b.num_tokens == 9
    # once a finishes, b is recomputed as a prefill of all its tokens (prompt + generated)
    sched.finish(a, FinishReason.LENGTH)
    scheduled, is_prefill = sched.schedule()
    assert is_prefill and scheduled == [b] and len(b.block_table) == 3
    # b's blocks were freed suffix first, so its second block was handed to a; the first is a hit
    assert b.num_cached_tokens == 4
    sched.finish(b, FinishReason.LENGTH)
    assert bm.is_whole()


def test_only_sequence_preempts_itself_when_pool_exhausted():
    sched, bm = make(num_blocks=1)
    a = seq(4)
    sched.add(a)
    sched.schedule()
    decode_one(sched, [a])
    scheduled, _ = sched.schedule()
    assert scheduled == [] and a.status == SequenceStatus.WAITING and bm.is_whole()


def test_stop_reasons():
    sched, _ = make(max_tokens=16)
    s = Sequence([5, 6], SamplingParams(max_tokens=3, stop_token_ids=(9,)), BS)
    s.append_token(2)
    assert sched.stop_reason(s) == FinishReason.STOP
    s2 = Sequence([5, 6], SamplingParams(max_tokens=3, ignore_eos=True), BS)
    s2.append_token(2)
    assert sched.stop_reason(s2) is None
    s2.append_token(9), s2.append_token(4)
    assert sched.stop_reason(s2) == FinishReason.LENGTH
    s3 = Sequence([5, 6], SamplingParams(max_tokens=3, stop_token_ids=(9,)), BS)
    s3.append_token(9)
    assert sched.stop_reason(s3) == FinishReason.STOP
    long = Sequence(list(range(15)), SamplingParams(max_tokens=30), BS)
    long.append_token(4)
    assert sched.stop_reason(long) == FinishReason.LENGTH   # max_model_len 16 reached
