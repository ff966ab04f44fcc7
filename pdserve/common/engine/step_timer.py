"""Measured step times of one engine, for the router's estimates (WorkerStats) and the engine's
TPOT guard: exponential moving averages (weight ``ALPHA`` for the newest) of ``decode_step_ms``
(decode rows only), ``mixed_step_ms`` (decode rows and chunks), ``mixed_prompt_tokens`` (the prompt
tokens of those mixed steps), ``ms_per_prompt_token`` (what a mixed step took per prompt token
over the decode step then measured: ``(mixed - decode_step_ms) / prompt tokens``, never below 0,
from mixed steps of at least MIN_MODEL_TOKENS prompt tokens)
and ``prefill_tokens_per_s`` (steps computing prompt tokens). Each timed ``LLMEngine.step`` call
that returned work counts; zero = not measured yet.
"""
from __future__ import annotations

ALPHA = 0.2
MIN_MODEL_TOKENS = 64   # smaller chunks leave ms_per_prompt_token alone: step-time noise over few tokens


def _ewma(old: float, new: float) -> float:
    return new if old == 0.0 else (1 - ALPHA) * old + ALPHA * new


class StepTimer:
    def __init__(self) -> None:
        self.decode_step_ms = 0.0
        self.mixed_step_ms = 0.0
        self.mixed_prompt_tokens = 0.0
        self.ms_per_prompt_token = 0.0
        self.prefill_tokens_per_s = 0.0

    def record(self, seconds: float, num_prefill_tokens: int, num_decode_rows: int) -> None:
        """One step's wall time and what it computed."""
        if seconds <= 0.0 or (num_prefill_tokens == 0 and num_decode_rows == 0):
            return
        ms = seconds * 1e3
        if num_prefill_tokens == 0:
            self.decode_step_ms = _ewma(self.decode_step_ms, ms)
            return
        if num_decode_rows:
            self.mixed_step_ms = _ewma(self.mixed_step_ms, ms)
            self.mixed_prompt_tokens = _ewma(self.mixed_prompt_tokens, float(num_prefill_tokens))
            if self.decode_step_ms > 0.0 and num_prefill_tokens >= MIN_MODEL_TOKENS:
                extra = max(ms - self.decode_step_ms, 0.0) / num_prefill_tokens
                self.ms_per_prompt_token = _ewma(self.ms_per_prompt_token, extra)
        self.prefill_tokens_per_s = _ewma(self.prefill_tokens_per_s, num_prefill_tokens / seconds)

    def stats(self) -> dict[str, float]:
        return {"decode_step_ms": self.decode_step_ms, "mixed_step_ms": self.mixed_step_ms,
                "mixed_prompt_tokens": self.mixed_prompt_tokens, "ms_per_prompt_token": self.ms_per_prompt_token,
                "prefill_tokens_per_s": self.prefill_tokens_per_s}
