"""The TPOT guard: how many prompt tokens a step with decode rows may carry, so that its decode
rows keep their time-per-output-token target on average, with no step longer than the ITL bound.

The step-time model is the engine's own measurement (:class:`StepTimer`): ``t_dec``, the recent
decode-only step, and ``c``, the extra milliseconds a mixed step took per prompt token over
``t_dec``. A step with decode rows and ``p`` prompt tokens is predicted to take ``t_dec + c * p``.
The guard keeps a credit ``S`` (ms): after each step with decode rows, ``S += goal - step``
(clipped to ``[-goal, CREDIT_CAP_SHARE * goal]``), so decode-only steps, shorter than the goal, save time that a
later mixed step spends (a mixed step has a fixed cost of its own, so fewer, larger chunks
carry more prompt tokens per millisecond of the decode rows' time than one small chunk a step)::

    target = min(worker target, the tightest per-request target of the step's decode rows)
    goal   = target * (1 - margin)
    allowed = min(goal + S, MAX_STEP_SHARE * target)           (no step over the ITL bound)
    budget = floor((allowed - t_dec) / c), clamped to [MIN_CHUNK_TOKENS, ceiling]

The floor keeps prompts moving where the decode rows alone take the whole goal (the credit then
runs to ``-goal`` and the router sees the worker as full: its prefill rate is the floor's). A step
without decode rows has no TPOT to keep: its
budget is the ceiling (the engine's ``max_num_batched_tokens``, a prefill-sized step), so a worker
that is not decoding prefills at full GEMM efficiency. Until a mixed step was measured (``c`` = 0)
the budget is ``min(UNMEASURED_TOKENS, ceiling)``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.step_timer import StepTimer
from pdserve.common.worker_types import MIN_CHUNK_TOKENS  # the floor, which the router models too

UNMEASURED_TOKENS = 512     # the budget before the first mixed step is measured
MAX_STEP_SHARE = 2.0        # no guarded step longer than this many targets (the ITL bound)
CREDIT_CAP_SHARE = 20.0     # the credit saved is at most this many goals (an average over ~20 steps)


def prompt_budget(target_ms: float, margin: float, credit_ms: float, decode_step_ms: float,
                  ms_per_prompt_token: float, ceiling: int) -> int:
    """Prompt tokens allowed beside decode rows (module docstring); ``target_ms`` > 0."""
    if ms_per_prompt_token <= 0.0 or decode_step_ms <= 0.0:
        return min(UNMEASURED_TOKENS, ceiling)
    allowed = min(target_ms * (1.0 - margin) + credit_ms, MAX_STEP_SHARE * target_ms)
    n = math.floor(max(allowed - decode_step_ms, 0.0) / ms_per_prompt_token)
    return min(ceiling, max(n, MIN_CHUNK_TOKENS))


def step_target_ms(worker_target_ms: float, rows: Seq[Sequence]) -> float:
    """The tightest TPOT target among the worker's and its decode rows' own; 0 = none."""
    targets = [s.tpot_slo_ms for s in rows if s.tpot_slo_ms > 0.0]
    if worker_target_ms > 0.0:
        targets.append(worker_target_ms)
    return min(targets) if targets else 0.0


@dataclass
class TpotGuard:
    """The guard of one engine: ``budget(decode_rows, ceiling)`` for its scheduler, ``observe``
    after every step."""

    timer: StepTimer
    target_ms: float = 0.0      # the worker's target; 0 = only requests that set one are guarded
    margin: float = 0.0         # share of the target kept free for the model's error
    credit_ms: float = 0.0      # S
    _goal_ms: float = 0.0       # the goal of the last guarded step (0: the last step was not guarded)

    def __post_init__(self) -> None:
        if self.target_ms < 0.0:
            raise ValueError(f"tpot_target_ms must be >= 0 (0 = off), got {self.target_ms}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"tpot_margin must be in [0, 1), got {self.margin}")

    def budget(self, decode_rows: Seq[Sequence], ceiling: int) -> int:
        """Prompt tokens the step may carry beside ``decode_rows`` (at most ``ceiling``)."""
        target = step_target_ms(self.target_ms, decode_rows) if decode_rows else 0.0
        self._goal_ms = target * (1.0 - self.margin)
        if target <= 0.0:
            return ceiling
        t = self.timer
        return prompt_budget(target, self.margin, self.credit_ms, t.decode_step_ms, t.ms_per_prompt_token, ceiling)

    def observe(self, step_ms: float, num_decode_rows: int) -> None:
        """A step ended: a guarded step with decode rows moves the credit by ``goal - step_ms``."""
        if self._goal_ms > 0.0 and num_decode_rows:
            g = self._goal_ms
            self.credit_ms = max(-g, min(CREDIT_CAP_SHARE * g, self.credit_ms + g - step_ms))
