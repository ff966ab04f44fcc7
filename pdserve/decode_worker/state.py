"""The decode worker's requests: reservations under a lease, KV receives, admission, outputs.

A request's handoff moves RESERVED -> RECEIVING -> ACTIVE (:class:`Phase`; Submit starts at
ACTIVE): RESERVED holds blocks under a lease until PushKV; RECEIVING while its blocks are
written (a cancel then only marks it, the blocks are freed when the receive ends); ACTIVE in the
engine's batch. A reservation's lease follows its request: the router renews it (``renew``)
while the request waits for its prefill, so only a reservation whose router stopped renewing
(its KV will never come) expires.

Every method whose first argument is ``engine`` runs under the engine's state lock
(:class:`pdserve.common.serving.engine_loop.EngineLoop`): on the engine thread between steps
(``EngineLoop.call``, the hooks) or off it (``EngineLoop.now``: Reserve, Submit, PushKV, Cancel,
renewals), possibly while a step computes. Such a method never touches a sequence a step may
hold: a request in the running batch is ended on the engine thread, after the step (``_end``).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum

from pdserve.common.engine.handoff import InvalidFirstToken
from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.outputs import FinishReason, SequenceOutput
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.broadcast import Broadcast
from pdserve.common.serving.cancels import Tombstones
from pdserve.common.serving.engine_loop import EngineLoop
from pdserve.common.serving.metrics import KIND_LOCAL, KIND_REMOTE, RequestTracker, WorkerMetrics

logger = logging.getLogger(__name__)
# The error of a reservation whose lease ran out (the router reports it as RESOURCE_EXHAUSTED:
# the blocks could not be held for the request, not a fault).
LEASE_EXPIRED = "reservation lease expired"


class Phase(Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    ACTIVE = "active"


NEXT_PHASE = {Phase.RESERVED: Phase.RECEIVING, Phase.RECEIVING: Phase.ACTIVE}


class NoSuchRequest(KeyError):
    """Unknown, expired or cancelled request id."""


class BadTransfer(ValueError):
    """A PushKV that does not match its reservation."""


class CancelledBefore(Exception):
    """A request whose id a Cancel already named (the Cancel overtook it)."""


@dataclass
class Tracked:
    seq: Sequence
    router_id: str
    deadline: float | None         # Unix seconds
    lease_expires: float | None    # Unix seconds, while RESERVED
    phase: Phase
    lease_s: float = 0.0           # how far a renewal extends the lease
    cancel_reason: FinishReason | None = None
    first_sent: bool = False

    def advance(self, to: Phase) -> None:
        """The handoff's one legal move from the current phase."""
        if NEXT_PHASE.get(self.phase) is not to:
            raise RuntimeError(f"request {self.seq.request_id!r}: no move {self.phase.value} -> {to.value}")
        self.phase = to


class DecodeState:
    """``loop``: the engine loop whose thread ends running requests (None: every method runs on
    the engine thread, as in unit tests); ``cancelled``: ids a Cancel named (refused later)."""

    def __init__(self, outputs: Broadcast, default_lease_ms: int, tracker: RequestTracker | None = None,
                 loop: EngineLoop | None = None, cancelled: Tombstones | None = None) -> None:
        self.outputs = outputs
        self.tracker = tracker or RequestTracker(WorkerMetrics("decode"))   # metrics and spans per request
        self.default_lease_ms = default_lease_ms
        self.loop = loop
        self.cancelled = cancelled if cancelled is not None else Tombstones()
        self.tracked: dict[str, Tracked] = {}
        self.num_transfers = 0          # receives completed
        self.transfer_bytes = 0

    def _check_new(self, request_id: str) -> None:
        if request_id in self.cancelled:
            raise CancelledBefore(f"request {request_id!r} was cancelled before it arrived")

    # ---- admission paths -------------------------------------------------------------
    def reserve(self, engine: LLMEngine, request_id: str, token_ids: list[int], params: SamplingParams,
                lease_ms: int, deadline: float | None, router_id: str, tpot_slo_ms: float = 0.0
                ) -> tuple[list[int], int]:
        """``tpot_slo_ms``: the request's own TPOT objective for the guard (0 = the worker's)."""
        self._check_new(request_id)
        seq = engine.kv_handoff.reserve(token_ids, params, request_id)
        seq.tpot_slo_ms = tpot_slo_ms
        lease = (lease_ms or self.default_lease_ms) / 1000.0
        self.tracked[request_id] = Tracked(seq, router_id, deadline, time.time() + lease, Phase.RESERVED, lease)
        self.tracker.begin(request_id, KIND_REMOTE, "Reserve")
        return list(seq.block_table), seq.num_cached_tokens

    def submit(self, engine: LLMEngine, request_id: str, token_ids: list[int], params: SamplingParams,
               deadline: float | None, router_id: str, tpot_slo_ms: float = 0.0) -> None:
        self._check_new(request_id)
        seq = engine.add_request(token_ids, params, request_id, tpot_slo_ms=tpot_slo_ms)
        self.tracked[request_id] = Tracked(seq, router_id, deadline, None, Phase.ACTIVE)
        self.tracker.begin(request_id, KIND_LOCAL, "Submit")

    def start_receive(self, engine: LLMEngine, request_id: str, block_ids: list[int]) -> Tracked:
        """Check a PushKV against its reservation and move it to RECEIVING (BadTransfer when the
        block ids do not match it: the reservation stays; NoSuchRequest when there is none)."""
        t = self.tracked.get(request_id)
        if t is None or t.phase is not Phase.RESERVED:
            raise NoSuchRequest(f"request {request_id!r} has no live reservation here")
        expected = t.seq.block_table[t.seq.num_cached_tokens // t.seq.block_size:]
        if list(block_ids) != expected:
            raise BadTransfer(f"block_ids {list(block_ids)[:8]} do not match the reservation {expected[:8]}")
        t.advance(Phase.RECEIVING)
        t.lease_expires = None
        return t

    def renew(self, engine: LLMEngine, router_id: str, request_ids: list[str]) -> list[str]:
        """Extend the leases of ``router_id``'s reservations ``request_ids`` (each by its own
        lease); the ids of those it no longer has (expired, cancelled, finished or unknown).
        Requests past RESERVED have no lease and are simply still held."""
        now, lost = time.time(), []
        for rid in request_ids:
            t = self.tracked.get(rid)
            if t is None or t.router_id != router_id:
                lost.append(rid)
            elif t.phase is Phase.RESERVED:
                t.lease_expires = now + t.lease_s
        return lost

    def refuse_push(self, engine: LLMEngine, request_id: str, error: str) -> bool:
        """A PushKV for ``request_id`` was refused before anything was posted: end its
        reservation (blocks freed, ERROR output). A request past RESERVED is not touched (a
        receive may be writing its blocks); False when nothing was ended."""
        t = self.tracked.get(request_id)
        if t is None or t.phase is not Phase.RESERVED:
            return False
        self._drop(engine, t, FinishReason.ERROR, f"PushKV refused: {error}")
        return True

    def finish_receive(self, engine: LLMEngine, request_id: str, first_token: int, logprob: float,
                       event, error: BaseException | None, num_bytes: int = 0) -> None:
        """The KV landed (or failed): admit the sequence with its first token, or drop it. A
        first token the engine refuses (outside the vocabulary) drops the request with an error
        before it joins the batch; the other requests never see it."""
        t = self.tracked.get(request_id)
        if t is None:
            return
        if error is not None or t.cancel_reason is not None:
            reason = t.cancel_reason or FinishReason.ERROR
            self._drop(engine, t, reason, f"KV transfer failed: {error}" if error else "")
            return
        if event is not None:
            event.wait()   # the decode stream waits for the scatter; no host sync
        try:
            engine.kv_handoff.check_first_token(first_token, logprob)
        except InvalidFirstToken as e:
            logger.warning("request %s: KV transfer refused: %s", request_id, e)
            self._drop(engine, t, FinishReason.ERROR, f"KV transfer refused: {e}")
            return
        self.num_transfers += 1
        self.transfer_bytes += num_bytes
        t.advance(Phase.ACTIVE)
        self.tracker.ready(request_id)
        if not engine.kv_handoff.admit(t.seq, first_token, logprob):
            # sample 0 ended on its first token (the router has it); its forks, if any, run on
            self._emit(t, finished_output(t.seq, _finish_reason(t.seq)))
            if t.seq.all_samples_finished:
                self.tracker.end(request_id, _finish_reason(t.seq))
                del self.tracked[request_id]

    # ---- endings ---------------------------------------------------------------------
    def cancel(self, engine: LLMEngine, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request: its blocks freed now, or (a receive writing them, or a step that may be
        computing it) as soon as that ends. False when it is not here."""
        t = self.tracked.get(request_id)
        if t is None:
            return False
        if t.phase is Phase.RECEIVING:       # blocks are being written: free them when the receive ends
            t.cancel_reason = reason
            return True
        if t.phase is Phase.ACTIVE and t.seq.status is SequenceStatus.RUNNING and not self._between_steps():
            if t.cancel_reason is None:      # in the batch: a step may be computing it
                t.cancel_reason = reason
                assert self.loop is not None
                self.loop.call(lambda e: self._end(e, request_id, reason))
            return True
        self._drop(engine, t, reason)        # reserved, or waiting for its prefill: in no step
        return True

    def _between_steps(self) -> bool:
        return self.loop is None or self.loop.on_engine_thread()

    def _end(self, engine: LLMEngine, request_id: str, reason: FinishReason) -> None:
        """On the engine thread: end a running request a cancel marked (unless it ended meanwhile)."""
        t = self.tracked.get(request_id)
        if t is not None:
            self._drop(engine, t, reason)

    def cancel_router(self, engine: LLMEngine, router_id: str) -> int:
        ids = [rid for rid, t in self.tracked.items() if t.router_id == router_id]
        for rid in ids:
            self.cancel(engine, rid)
        return len(ids)

    def _drop(self, engine: LLMEngine, t: Tracked, reason: FinishReason, error: str = "") -> None:
        """End the request, every sample of it still running: one last output each."""
        live = [s for s in t.seq.samples if not s.is_finished] or [t.seq]
        engine.abort(t.seq.request_id, reason)
        self.tracker.end(t.seq.request_id, reason)
        self.tracked.pop(t.seq.request_id, None)
        self.outputs.publish(t.router_id, [finished_output(s, reason, error) for s in live])

    def expire(self, engine: LLMEngine) -> None:
        """Before each step: end reservations whose lease ran out and requests past their deadline."""
        now = time.time()
        for t in list(self.tracked.values()):
            if t.phase is Phase.RESERVED and t.lease_expires is not None and now > t.lease_expires:
                logger.warning("reservation %s expired before its KV arrived", t.seq.request_id)
                self.tracker.reservation_expired()
                self._drop(engine, t, FinishReason.ERROR, LEASE_EXPIRED)
            elif t.deadline is not None and now > t.deadline and t.cancel_reason is None:
                self.cancel(engine, t.seq.request_id, FinishReason.DEADLINE)

    # ---- outputs ---------------------------------------------------------------------
    def _emit(self, t: Tracked, update: SequenceOutput) -> None:
        self.outputs.publish(t.router_id, [update])

    def on_step(self, out: StepOutput) -> None:
        """Publish a step's tokens and endings: one output per (request, sample) and router; a
        request is forgotten once all its samples finished."""
        by_router: dict[str, dict[tuple[str, int], SequenceOutput]] = {}
        for seq, token in zip(out.seqs, out.new_token_ids):
            t = self.tracked.get(seq.request_id)
            if t is None:
                continue
            u = SequenceOutput(seq.request_id, [token],
                          [seq.output_logprobs[-1]] if seq.sampling_params.logprobs and seq.output_logprobs else [],
                          index=seq.index)
            if seq.sampling_params.top_logprobs and seq.output_top_logprobs:
                u.top_logprobs = [seq.output_top_logprobs[-1]]
            if not t.first_sent and seq.index == 0:
                u.num_prompt_tokens, u.num_cached_tokens = seq.num_prompt_tokens, seq.num_prefix_hit_tokens
                u.prompt_logprobs = list(seq.prompt_logprobs or ())      # co-located: computed here
                u.prompt_top_logprobs = list(seq.prompt_top_logprobs or ())
                t.first_sent = True
            by_router.setdefault(t.router_id, {})[(seq.request_id, seq.index)] = u
        for seq in out.finished:
            t = self.tracked.get(seq.request_id)
            if t is None:
                continue
            reason = _finish_reason(seq)
            key = (seq.request_id, seq.index)
            u = by_router.setdefault(t.router_id, {}).setdefault(key, finished_output(seq, reason))
            u.finish_reason = reason
        for seq in out.finished:          # after all: samples of one request may end in one step
            if seq.all_samples_finished:
                self.tracked.pop(seq.request_id, None)
        for router_id, updates in by_router.items():
            self.outputs.publish(router_id, list(updates.values()))

    def num_reserved(self) -> int:
        """Read from any thread (a snapshot of the values: the dict may change meanwhile)."""
        return sum(t.phase is not Phase.ACTIVE for t in list(self.tracked.values()))


def _finish_reason(seq: Sequence) -> FinishReason:
    """The reason of a sequence the engine reported finished (the engine always sets one)."""
    if seq.finish_reason is None:
        raise RuntimeError(f"request {seq.request_id!r} finished without a finish reason")
    return seq.finish_reason


def resolve_receive(loop: EngineLoop, state: DecodeState, request_id: str, first_token: int,
                    logprob: float, future: Future) -> None:
    """Callback of a KV receive future: hand the result to the engine thread."""
    error = future.exception()
    num_bytes, event, on_channel = (0, None, None) if error is not None else future.result()
    if on_channel is not None:            # the first token came after the blocks
        first_token, logprob = on_channel
    loop.call(lambda engine: state.finish_receive(engine, request_id, first_token, logprob, event, error, num_bytes))


def finished_output(seq: Sequence, reason: FinishReason, error: str = "") -> SequenceOutput:
    return SequenceOutput(seq.request_id, finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                          num_cached_tokens=seq.num_prefix_hit_tokens, error=error, index=seq.index)
