"""The TPOT guard: how many prompt tokens a step with decode rows may carry, so that the step
still ends within the time-per-output-token target of its decode rows.

The step-time model is the engine's own measurement (:class:`StepTimer`): ``t_dec``, the recent
decode-only step, and ``c``, the extra milliseconds a mixed step took per prompt token over
``t_dec``. A step with decode rows and ``p`` prompt tokens is predicted to take ``t_dec + c * p``,
so the guard allows::

    target = min(worker target, the tightest per-request target of the step's decode rows)
    budget = floor((target * (1 - margin) - t_dec) / c), clamped to [MIN_CHUNK_TOKENS, ceiling]

A step without decode rows has no TPOT to keep: its budget is the ceiling (the engine's
``max_num_batched_tokens``, a prefill-sized step), so a worker that is not decoding prefills at
full GEMM efficiency. Until a mixed step was measured (``c`` = 0) the budget is
``min(UNMEASURED_TOKENS, ceiling)``. When the decode rows alone take the whole target, the budget
is MIN_CHUNK_TOKENS: prompts still make progress, and the router sees the worker as full.

The linear model over-prices small chunks (a mixed step reads the weights once for its decode rows
and its prompt tokens together), so ``c`` measured at one budget is an average; the budget it
yields converges to the size whose step meets the target (each mixed step re-measures ``c``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.step_timer import StepTimer

MIN_CHUNK_TOKENS = 32       # a guarded step still computes this many prompt tokens
UNMEASURED_TOKENS = 512     # the budget before the first mixed step is measured


def prompt_budget(target_ms: float, margin: float, decode_step_ms: float, ms_per_prompt_token: float,
                  ceiling: int) -> int:
    """Prompt tokens allowed beside decode rows (module docstring); ``target_ms`` > 0."""
    floor = min(MIN_CHUNK_TOKENS, ceiling)
    if ms_per_prompt_token <= 0.0 or decode_step_ms <= 0.0:
        return min(UNMEASURED_TOKENS, ceiling)
    slack = target_ms * (1.0 - margin) - decode_step_ms
    if slack <= 0.0:
        return floor
    return max(floor, min(ceiling, math.floor(slack / ms_per_prompt_token)))


def step_target_ms(worker_target_ms: float, rows: Seq[Sequence]) -> float:
    """The tightest TPOT target among the worker's and its decode rows' own; 0 = none."""
    targets = [s.tpot_slo_ms for s in rows if s.tpot_slo_ms > 0.0]
    if worker_target_ms > 0.0:
        targets.append(worker_target_ms)
    return min(targets) if targets else 0.0


@dataclass
class TpotGuard:
    """The guard of one engine: ``budget(decode_rows, ceiling)`` for its scheduler."""

    timer: StepTimer
    target_ms: float = 0.0      # the worker's target; 0 = only requests that set one are guarded
    margin: float = 0.1         # share of the target kept free for the model's error

    def __post_init__(self) -> None:
        if self.target_ms < 0.0:
            raise ValueError(f"tpot_target_ms must be >= 0 (0 = off), got {self.target_ms}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"tpot_margin must be in [0, 1), got {self.margin}")

    def budget(self, decode_rows: Seq[Sequence], ceiling: int) -> int:
        """Prompt tokens the step may carry beside ``decode_rows`` (at most ``ceiling``)."""
        if not decode_rows:
            return ceiling
        target = step_target_ms(self.target_ms, decode_rows)
        if target <= 0.0:
            return ceiling
        t = self.timer
        return prompt_budget(target, self.margin, t.decode_step_ms, t.ms_per_prompt_token, ceiling)
