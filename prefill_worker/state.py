"""The prefill worker's requests: queued for a batched prefill, first token out, KV held for shipping.

Methods whose first argument is ``engine`` run on the engine thread.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from common.engine.llm_engine import LLMEngine, StepOutput
from common.engine.sampling_params import SamplingParams
from common.engine.sequence import FinishReason, Sequence


class PrefillAborted(Exception):
    """The request ended before its first token (cancel or deadline); ``reason`` says which."""

    def __init__(self, reason: FinishReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


@dataclass
class FirstTokenResult:
    token_id: int
    logprob: float
    num_cached_tokens: int
    finish_reason: FinishReason | None   # set when the first token ends the request


@dataclass
class Pending:
    seq: Sequence
    deadline: float | None
    first: asyncio.Future


class PrefillState:
    def __init__(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self.aio_loop = aio_loop
        self.pending: dict[str, Pending] = {}   # waiting for the first token

    def start(self, engine: LLMEngine, request_id: str, token_ids: list[int], params: SamplingParams,
              deadline: float | None, first: asyncio.Future) -> None:
        seq = engine.add_request(token_ids, params, request_id, prefill_only=True)
        self.pending[request_id] = Pending(seq, deadline, first)

    def _resolve(self, p: Pending, result=None, error: BaseException | None = None) -> None:
        def set_() -> None:
            if p.first.done():
                return
            if error is not None:
                p.first.set_exception(error)
            else:
                p.first.set_result(result)
        self.aio_loop.call_soon_threadsafe(set_)

    def on_step(self, out: StepOutput) -> None:
        for seq in out.finished:
            p = self.pending.pop(seq.request_id, None)
            if p is None:
                continue
            logprob = seq.output_logprobs[-1] if seq.output_logprobs else 0.0
            self._resolve(p, FirstTokenResult(seq.last_token, logprob, seq.num_prefix_hit_tokens, seq.finish_reason))

    def cancel(self, engine: LLMEngine, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request before its first token; once its KV is held, ``release`` ends it."""
        p = self.pending.pop(request_id, None)
        if p is None:
            return False
        engine.abort(request_id, reason)
        self._resolve(p, error=PrefillAborted(reason))
        return True

    def release(self, engine: LLMEngine, request_id: str) -> None:
        """Free the blocks held for shipping (after the transfer, or when it failed)."""
        engine.abort(request_id)

    def expire(self, engine: LLMEngine) -> None:
        now = time.time()
        for rid, p in list(self.pending.items()):
            if p.deadline is not None and now > p.deadline:
                self.cancel(engine, rid, FinishReason.DEADLINE)
