"""The prefill worker's requests: the prefill side of the KV handoff.

A request moves QUEUED -> LAUNCHED -> first token out (:class:`Phase`). QUEUED: a cancel frees its
blocks at once (or, when a step may be computing it, right after that step). LAUNCHED: a KV send
may read its blocks, so only the servicer frees them (``release``, after the send) and a cancel
only ends the wait. Methods whose first argument is ``engine`` run under the engine's state lock:
on the engine thread between steps, or off it (``EngineLoop.now``: a new Prefill, a Cancel),
possibly while a step computes.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum

import torch

from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.engine.model_runner import LaunchedStep
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.kv_transfer import FirstTokenRef
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.cancels import Tombstones
from pdserve.common.serving.engine_loop import EngineLoop
from pdserve.common.serving.metrics import KIND_PREFILL, RequestTracker, WorkerMetrics


class Phase(Enum):
    QUEUED = "queued"
    LAUNCHED = "launched"


class CancelledBefore(Exception):
    """A request whose id a Cancel already named (the Cancel overtook it)."""


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
    top_logprobs: tuple[list[int], list[float]] | None = None     # when params.top_logprobs
    prompt_logprobs: list[float] | None = None                   # when params.prompt_logprobs
    prompt_top_logprobs: list[tuple[list[int], list[float]]] | None = None


@dataclass
class LaunchedPrefill:
    """A request's prefill step is on the device: what a KV send needs, snapshot on the engine
    thread. ``kv_ready``: CUDA event after the step (None on CPU, where it is already done)."""
    block_table: list[int]
    kv_ready: torch.cuda.Event | None
    first_token: FirstTokenRef


@dataclass
class Pending:
    seq: Sequence
    deadline: float | None
    first: asyncio.Future       # -> FirstTokenResult, or PrefillAborted
    launched: asyncio.Future    # -> LaunchedPrefill, or PrefillAborted if it ends before
    phase: Phase = Phase.QUEUED  # engine thread's view (LAUNCHED: a send may read its blocks)


class PrefillState:
    """``loop``: the engine loop whose thread ends requests a step may be computing (None: every
    method runs on the engine thread); ``cancelled``: ids a Cancel named (refused later)."""

    def __init__(self, aio_loop: asyncio.AbstractEventLoop, tracker: RequestTracker | None = None,
                 loop: EngineLoop | None = None, cancelled: Tombstones | None = None) -> None:
        self.aio_loop = aio_loop
        self.tracker = tracker or RequestTracker(WorkerMetrics("prefill"))   # metrics and spans per request
        self.loop = loop
        self.cancelled = cancelled if cancelled is not None else Tombstones()
        self.pending: dict[str, Pending] = {}   # waiting for the first token

    def start(self, engine: LLMEngine, request_id: str, token_ids: list[int], params: SamplingParams,
              deadline: float | None, first: asyncio.Future, launched: asyncio.Future) -> None:
        if request_id in self.cancelled:
            raise CancelledBefore(f"request {request_id!r} was cancelled before it arrived")
        seq = engine.add_request(token_ids, params, request_id, prefill_only=True)
        self.pending[request_id] = Pending(seq, deadline, first, launched)
        self.tracker.begin(request_id, KIND_PREFILL, "Prefill")

    def _set(self, future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
        def set_() -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
                future.exception()   # its Prefill call may be gone: not an unhandled error
            else:
                future.set_result(result)
        self.aio_loop.call_soon_threadsafe(set_)

    def _resolve(self, p: Pending, result=None, error: BaseException | None = None) -> None:
        self._set(p.first, result, error)
        if error is not None:
            self._set(p.launched, error=error)   # a no-op once launched

    def on_launch(self, seqs: list[Sequence], launched: LaunchedStep) -> None:
        """Engine hook: a prefill step was launched, its sampling enqueued; its requests may
        start shipping."""
        token_ids = launched.token_ids
        assert token_ids is not None, "on_launch comes after the step's sampling is enqueued"
        for row, seq in enumerate(seqs):
            p = self.pending.get(seq.request_id)
            if p is None or p.seq is not seq:
                continue
            self._set(p.launched, LaunchedPrefill(
                list(seq.block_table), seq.kv_ready,
                FirstTokenRef(token_ids, launched.logprobs, row)))
            p.phase = Phase.LAUNCHED
            self.tracker.launched(seq.request_id)

    def on_step(self, out: StepOutput) -> None:
        for seq in out.finished:
            p = self.pending.pop(seq.request_id, None)
            if p is None:
                continue
            logprob = seq.output_logprobs[-1] if seq.output_logprobs else 0.0
            top = seq.output_top_logprobs[-1] if seq.output_top_logprobs else None
            self._resolve(p, FirstTokenResult(seq.last_token, logprob, seq.num_prefix_hit_tokens, seq.finish_reason,
                                              top, seq.prompt_logprobs, seq.prompt_top_logprobs))

    def cancel(self, engine: LLMEngine, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request before its first token. Before its step is launched its blocks are
        freed here; after, ``release`` frees them (a send may be reading them)."""
        p = self.pending.pop(request_id, None)
        if p is None:
            return False
        if p.phase is Phase.QUEUED:
            if p.seq.status is SequenceStatus.WAITING or self.loop is None or self.loop.on_engine_thread():
                engine.abort(request_id, reason)
            else:       # in the batch: a step may be computing it; no send will read its blocks
                self.loop.call(lambda e: e.abort(request_id, reason))   # (on_launch skips it now)
        self._resolve(p, error=PrefillAborted(reason))
        self.tracker.end(request_id, reason)
        return True

    def release(self, engine: LLMEngine, request_id: str) -> None:
        """Free the request's blocks (after its KV send ended, or when none will run); a no-op
        when they are already free."""
        engine.abort(request_id)

    def expire(self, engine: LLMEngine) -> None:
        now = time.time()
        for rid, p in list(self.pending.items()):
            if p.deadline is not None and now > p.deadline:
                self.cancel(engine, rid, FinishReason.DEADLINE)
