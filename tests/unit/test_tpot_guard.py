"""The TPOT guard (engine/tpot_guard.py): the budget formula by hand, the step target from the
worker's and the requests' own, the step-time model it reads (StepTimer), and the scheduler
under it: prompt chunks sized by the guard beside decode rows, the whole budget without them."""
from __future__ import annotations

import pytest

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.step_timer import StepTimer
from pdserve.common.engine.tpot_guard import (
    MIN_CHUNK_TOKENS,
    UNMEASURED_TOKENS,
    TpotGuard,
    prompt_budget,
    step_target_ms,
)
from pdserve.common.sampling_params import SamplingParams

BS = 4


def seq(n: int, tpot: float = 0.0) -> Sequence:
    s = Sequence(list(range(10, 10 + n)), SamplingParams(max_tokens=64), BS)
    s.tpot_slo_ms = tpot
    return s


def test_budget_by_hand():
    # target 12 ms, margin 0.1 -> goal 10.8 ms; no credit; decode step 5.4 ms leaves 5.4 ms; at 0.02 ms: 270
    assert prompt_budget(12.0, 0.1, 0.0, 5.4, 0.02, 4096) == 270
    # 6 ms of credit saved by shorter steps: 10.8 + 6 = 16.8 allowed -> (16.8 - 5.4) / 0.02 = 570
    assert prompt_budget(12.0, 0.1, 6.0, 5.4, 0.02, 4096) == 570
    # never over the ITL bound of 2 targets (24 ms): (24 - 5.4) / 0.02 = 930
    assert prompt_budget(12.0, 0.1, 50.0, 5.4, 0.02, 4096) == 930
    # the ceiling caps it: 5.4 / 0.001 = 5400 > 4096
    assert prompt_budget(12.0, 0.1, 0.0, 5.4, 0.001, 4096) == 4096
    # owed time (negative credit) or decode rows alone over the goal: the floor
    assert prompt_budget(12.0, 0.1, -3.0, 9.0, 0.02, 4096) == MIN_CHUNK_TOKENS
    assert prompt_budget(12.0, 0.1, 0.0, 11.0, 0.02, 4096) == MIN_CHUNK_TOKENS
    assert prompt_budget(12.0, 0.1, 0.0, 10.5, 0.02, 4096) == MIN_CHUNK_TOKENS   # (10.8 - 10.5) / 0.02 = 15
    assert prompt_budget(12.0, 0.1, 0.0, 11.0, 0.02, 8) == 8                    # a ceiling under the floor
    # unmeasured model: the fixed start
    assert prompt_budget(12.0, 0.1, 0.0, 0.0, 0.02, 4096) == UNMEASURED_TOKENS
    assert prompt_budget(12.0, 0.1, 0.0, 5.0, 0.0, 300) == 300


def test_step_target_is_the_tightest():
    assert step_target_ms(12.0, [seq(4), seq(4, tpot=8.0)]) == 8.0
    assert step_target_ms(12.0, [seq(4, tpot=20.0)]) == 12.0
    assert step_target_ms(0.0, [seq(4, tpot=20.0), seq(4)]) == 20.0
    assert step_target_ms(0.0, [seq(4)]) == 0.0


def test_guard_reads_the_timer_and_keeps_credit():
    timer = StepTimer()
    guard = TpotGuard(timer, target_ms=10.0, margin=0.0)
    rows = [seq(4)]
    assert guard.budget([], 4096) == 4096                    # no decode rows: a prefill-sized step
    assert guard.budget(rows, 4096) == UNMEASURED_TOKENS
    timer.record(0.004, 0, 8)                                # decode step 4 ms
    timer.record(0.006, 200, 8)                              # mixed: 2 ms over it for 200 tokens
    assert timer.ms_per_prompt_token == pytest.approx(0.01)
    assert timer.mixed_prompt_tokens == 200
    assert guard.budget(rows, 4096) == 600                   # (10 - 4) / 0.01
    guard.observe(4.0, 8)                                    # a 4 ms step under the 10 ms goal: +6
    assert guard.credit_ms == pytest.approx(6.0)
    assert guard.budget(rows, 4096) == 1200                  # (10 + 6 - 4) / 0.01
    guard.observe(30.0, 8)                                   # 20 ms over: clipped at -10
    assert guard.credit_ms == pytest.approx(-10.0)
    assert guard.budget(rows, 4096) == MIN_CHUNK_TOKENS      # owed: the floor
    guard.observe(30.0, 0)                                   # a step without decode rows: no change
    assert guard.credit_ms == pytest.approx(-10.0)
    assert TpotGuard(timer).budget(rows, 4096) == 4096       # off: no target anywhere
    assert TpotGuard(timer).budget([seq(4, tpot=6.0)], 4096) == 200   # its own: (6 - 4) / 0.01 (margin 0)


def test_timer_model_moves_with_measurements():
    timer = StepTimer()
    timer.record(0.005, 0, 4)
    timer.record(0.007, 100, 4)     # 0.02 ms a token
    timer.record(0.009, 100, 4)     # 0.04: EWMA 0.8 * 0.02 + 0.2 * 0.04
    assert timer.ms_per_prompt_token == pytest.approx(0.024)
    timer.record(0.05, 1000, 0)     # a prefill-only step does not touch the mixed model
    assert timer.ms_per_prompt_token == pytest.approx(0.024)


def test_guard_rejects_bad_settings():
    with pytest.raises(ValueError, match="tpot_target_ms"):
        TpotGuard(StepTimer(), target_ms=-1.0)
    with pytest.raises(ValueError, match="tpot_margin"):
        TpotGuard(StepTimer(), margin=1.0)


def test_scheduler_sizes_chunks_by_the_guard():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
                                      eos_token_ids=(2,)), BlockManager(128, BS))
    seen: list[tuple[int, int]] = []

    def budget(rows: list[Sequence], left: int) -> int:
        seen.append((len(rows), left))
        return 10
    sched.prompt_budget = budget
    a, b = seq(8), seq(100)
    sched.add(a)
    steps = [sched.schedule()]
    assert [s.num_scheduled_tokens for s in steps[0][0]] == [8]     # no decode rows: whole budget
    assert seen == []
    a.num_cached_tokens += 8
    a.append_token(7)
    sched.add(b)
    seqs, is_prefill = sched.schedule()
    assert is_prefill and [(s is a, s.num_scheduled_tokens) for s in seqs] == [(True, 1), (False, 10)]
    assert seen == [(1, 63)]                                         # one row, 64 - 1 left


def test_guard_never_raises_the_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=1024,
                                      eos_token_ids=(2,)), BlockManager(128, BS))
    sched.prompt_budget = lambda rows, left: 1000
    a, b = seq(4), seq(100)
    sched.add(a)
    sched.schedule()
    a.num_cached_tokens += 4
    a.append_token(7)
    sched.add(b)
    seqs, _ = sched.schedule()
    assert [s.num_scheduled_tokens for s in seqs] == [1, 15]
