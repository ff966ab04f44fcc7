"""One try of one request on chosen workers: the worker-facing half of the request flow.

Remote prefill (``prefill`` set): Reserve(decode) -> Prefill(prefill, kv_target) -> FirstToken,
then the decode worker's Subscribe outputs. Local prefill (``prefill`` None, or Reserve refused
RESOURCE_EXHAUSTED): Submit(decode), then its outputs. ``next()`` returns the next step's merged
:class:`~pdserve.common.outputs.SequenceOutput` (``finish_reason`` None until the last). Failures
are raised as pdserve.router.failures classifies them: :class:`Retry` before the first token,
:class:`Cut` after it when another worker could continue, else the mapped domain error.

Timeouts: Reserve and Submit wait as long as the request's own deadline allows (the decode worker
answers them off its engine step; a worker that dies meanwhile breaks the output stream, which
cancels them), not a fixed control-call timeout. From Reserve's answer until the KV has crossed,
the reservation's lease is renewed (``WorkerClient.leases``); a reservation the decode worker could
not hold (its lease ran out) fails the try with RESOURCE_EXHAUSTED, never INTERNAL.
"""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import grpc.aio

from pdserve.common.grpc_utils import DeadlineExceeded, Internal, ResourceExhausted, Unavailable, unavailable_peer
from pdserve.common.outputs import SequenceOutput
from pdserve.common.worker_types import Reservation
from pdserve.router.failures import Cut, Retry, classify, finish_error
from pdserve.router.pd_policy import PdDecision
from pdserve.router.prefill_call import PrefillRequest, PrefillStream, prefill_request
from pdserve.router.subscription import OutputBuffer, Subscription
from pdserve.router.worker_client import DRAINING, WorkerClient

__all__ = ["Attempt", "Cut", "Retry"]     # Cut and Retry: pdserve.router.failures

log = logging.getLogger(__name__)

# Reserve / Submit of a request without a deadline wait at most this long for their answer.
NO_DEADLINE_ADMIT_TIMEOUT_S = 60.0


class Attempt:
    def __init__(self, flow, job, decode: WorkerClient, prefill: WorkerClient | None,
                 worker_request_id: str, decision: PdDecision | None = None) -> None:
        self.flow = flow
        self.job = job
        self.decode = decode
        self.prefill = prefill
        self.rid = worker_request_id
        self.decision = decision         # pdserve.router.pd_policy's placement (its estimates), if any
        self.prompt_len = len(job.prompt.token_ids)
        self.queue: OutputBuffer | asyncio.Queue | None = None
        self.first_seen = False
        self.cached_tokens = 0
        self.expired = False
        self.prefill_call: PrefillStream | None = None
        self._prefill_task: asyncio.Task | None = None
        self._pending: BaseException | None = None
        self._held: list = []            # outputs of another sample than the last step's (n > 1)
        self._decode_broken: BaseException | None = None   # decode stream error before the first token
        self._admit_call: grpc.aio.UnaryUnaryCall | None = None   # Reserve / Submit in flight
        self._lease_held = False         # the decode worker's LeaseKeeper renews this reservation
        self._prefill_req: PrefillRequest | None = None   # built early (after_send)
        self._subscription: Subscription | None = None
        self._decode_load = 0
        self._prefill_load = False
        self._local_prompt = 0           # prompt tokens counted in the decode worker's queued prompt tokens
        self._prefill_queued = 0         # prompt tokens counted in the prefill worker's
        self.timer: asyncio.TimerHandle | None = None   # the deadline timer (set by the flow)
        self.closed = False

    # ---- start ------------------------------------------------------------------------
    def _admit_timeout(self) -> float:
        """Reserve's and Submit's: the request's own deadline (see the module doc)."""
        remaining = self.job.remaining()
        return NO_DEADLINE_ADMIT_TIMEOUT_S if remaining is None else max(0.001, remaining)

    def _fail(self, err: BaseException, worker: WorkerClient, where: str) -> BaseException:
        """Map ``err`` (an rpc error or a domain error) and decide whether to retry
        (pdserve.router.failures); an UNAVAILABLE may mark ``worker`` down first."""
        if isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.UNAVAILABLE:
            self._mark_down(err, worker, where)
        return classify(err, worker.key, where, self.first_seen, self.expired, self.job.expired)

    def _mark_down(self, err: grpc.aio.AioRpcError, worker: WorkerClient, where: str) -> None:
        """An UNAVAILABLE from ``worker`` marks it down, unless it names this request's decode
        worker as the peer at fault (a prefill worker whose KV the decode worker refused: the
        prefill worker is up, and the decode worker is left to its own health checks), or says
        the worker drains (its streams in flight go on: ``begin_drain``). The retry avoids
        ``worker`` either way: without it, the pair does not meet again for this request."""
        if DRAINING in (err.details() or ""):
            worker.begin_drain(f"{where}: {err.details()}")
            return
        peer = unavailable_peer(err)
        if peer and peer == self.decode.address and worker is not self.decode:
            log.info("request %s: %s on %s failed on the decode worker %s: %s", self.rid, where, worker.key,
                     self.decode.key, err.details())
            return
        worker.mark_down(f"{where}: {err.details()}")

    async def start(self) -> None:
        sub = self.decode.subscription
        if sub is None or not sub.open:
            raise Retry(Unavailable(f"decode worker {self.decode.key} has no open output stream"), self.decode.key)
        self._subscription = sub
        self.queue = sub.register(self.rid)
        self._decode_load = self.prompt_len
        self.decode.add_load(1, self._decode_load, decoding=1)
        job = self.job
        if self.prefill is None:
            await self._submit()
            return
        settings = self.flow.settings
        info = self.prefill.info
        kv_dtype = info.kv_cache_dtype if info is not None else ""
        tp, kv_heads, head_dim = (info.tensor_parallel_size, info.num_kv_heads, info.head_dim) if info else (0, 0, 0)
        call = self.decode.reserve(self.rid, job.prompt.wire_ids, job.sampling, settings.lease_ms,
                                   job.deadline_unix_ms, settings.router_id, self._admit_timeout(), job.slo.tpot_ms,
                                   kv_dtype, tp, kv_heads, head_dim)
        self.flow.dispatched(self)
        try:
            res = self.decode.reservation(await self._admitted(call))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # no room for the prompt's KV on the decode worker right now: let it queue the
                # request and prefill it locally when its scheduler has room (no transfer)
                self.prefill = None
                self.flow.metrics.pd.decisions.labels("local", "reserve-refused").inc()
                await self._submit()
                return
            raise self._fail(e, self.decode, "Reserve") from e
        self._start_prefill(res)

    async def _admitted(self, call: grpc.aio.UnaryUnaryCall):
        """Reserve's or Submit's answer; a break of the decode worker's output stream meanwhile
        cancels the call and fails the try at once."""
        self._admit_call = call
        q = self.queue if isinstance(self.queue, OutputBuffer) and self.queue.on_put is None else None
        if q is not None:
            q.on_put = self._on_decode_output
        try:
            return await call
        except asyncio.CancelledError:
            if self._decode_broken is not None:     # cancelled by _on_decode_output
                raise self._fail(self._decode_broken, self.decode, "output stream") from None
            raise
        finally:
            self._admit_call = None
            if q is not None:
                q.on_put = None

    def _start_prefill(self, res: Reservation) -> None:
        prefill = self._remote()
        q = self.queue
        if type(q) is OutputBuffer:
            # The decode worker's output stream broke while Reserve was in flight: fail now;
            # later breaks cancel the Prefill call (see _on_decode_output).
            broken = [x for x in q.items if isinstance(x, BaseException)] if q.items else None
            if broken:
                raise self._fail(broken[0], self.decode, "output stream")
            q.on_put = self._on_decode_output
        self._hold_lease(res)
        preq = self._prefill_req or self._new_prefill_request()
        self._prefill_queued = self._prefill_tokens(local=False)
        prefill.add_load(1, prompt_tokens=self._prefill_queued, computed=self._prefill_queued)
        self._prefill_load = True
        self.prefill_call = prefill.prefill(preq, res, self.decode.worker_id, self.decode.address,
                                            self.job.remaining(), self.job.sampling.logprobs)

    def _hold_lease(self, res: Reservation) -> None:
        """Keep the reservation's lease renewed until its KV has crossed (the Prefill stream ends)."""
        lease_ms = self.flow.settings.lease_ms
        lease_s = lease_ms / 1000 if lease_ms else max(1.0, res.lease_expires_unix_ms / 1000 - time.time())
        self.decode.leases.hold(self.rid, lease_s, self._lease_lost)
        self._lease_held = True

    def _release_lease(self) -> None:
        if self._lease_held:
            self._lease_held = False
            self.decode.leases.release(self.rid)

    def _lease_lost(self, message: str) -> None:
        """The decode worker no longer holds the reservation: the try fails RESOURCE_EXHAUSTED
        (before the first token: retried elsewhere)."""
        self._lease_held = False
        if self.closed:
            return
        err = ResourceExhausted(message)
        if not self.first_seen:
            self._on_decode_output(err)
        elif self.queue is not None:
            self.queue.put_nowait(err)

    def _remote(self) -> WorkerClient:
        """The prefill worker of a remote prefill (called only on that path)."""
        if self.prefill is None:
            raise RuntimeError(f"request {self.rid}: a remote prefill step without a prefill worker")
        return self.prefill

    def after_send(self) -> None:
        """Run by the flow right after the first rpc's send: the Prefill request (the prompt's ids
        copied) is built while Reserve is in flight, not after its answer."""
        if self.prefill is not None and self._prefill_req is None:
            self._prefill_req = self._new_prefill_request()

    def _new_prefill_request(self) -> PrefillRequest:
        job = self.job
        return prefill_request(self.rid, job.prompt.wire_ids, job.sampling, job.deadline_unix_ms)

    def _prefill_tokens(self, local: bool) -> int:
        """Prompt tokens the prefilling worker computes: the policy's figure for the place it
        chose, else the whole prompt."""
        d = self.decision
        if d is not None and (d.kind == "local") == local and d.prefill_tokens:
            return d.prefill_tokens
        return self.prompt_len

    def _release_local_prompt(self) -> None:
        if self._local_prompt:
            self.decode.add_load(prompt_tokens=-self._local_prompt)
            self._local_prompt = 0

    async def _submit(self) -> None:
        job = self.job
        self._local_prompt = self._prefill_tokens(local=True)
        self.decode.add_load(prompt_tokens=self._local_prompt, computed=self._local_prompt)
        call = self.decode.submit(self.rid, job.prompt.wire_ids, job.sampling, job.deadline_unix_ms,
                                  self.flow.settings.router_id, self._admit_timeout(), job.slo.tpot_ms)
        self.flow.dispatched(self)
        try:
            await self._admitted(call)
        except grpc.aio.AioRpcError as e:
            raise self._fail(e, self.decode, "Submit") from e

    # ---- steps ------------------------------------------------------------------------
    async def next(self) -> SequenceOutput:
        call = self.prefill_call
        if not self.first_seen and call is not None:
            return await self._first_token(call)
        if self._pending is not None:
            raise self._pending
        q = self.queue
        if q is None:
            raise RuntimeError(f"request {self.rid}: next() before start()")
        if self._held:                     # another sample's outputs, left by the last call
            items, self._held = self._held, []
        elif type(q) is OutputBuffer:
            if not q.items:
                await q.wait()
            items = q.take_all()           # everything that came since the last step
        else:                              # an asyncio.Queue
            items = [await q.get()]
            while not q.empty():
                items.append(q.get_nowait())
        step = SequenceOutput(self.rid)
        step.index = next((x.index for x in items if not isinstance(x, BaseException)), 0)
        for k, item in enumerate(items):   # merged into one step (one client message) per sample
            if not isinstance(item, BaseException) and item.index != step.index:
                self._held = items[k:]     # the next call's (n > 1: one sample per step)
                break
            if isinstance(item, BaseException):
                if step.token_ids:         # deliver the tokens first, fail on the next call
                    self.first_seen = True     # (so as a Cut, not a Retry: tokens went out)
                    self._pending = self._fail(item, self.decode, "output stream")
                    break
                raise self._fail(item, self.decode, "output stream")
            self._merge(step, item)
            if step.finish_reason is not None or self._pending is not None:
                self._held = items[k + 1:]
                break
        n = len(step.token_ids)
        if n:
            self._decode_load += n
            self.decode.add_load(0, n)
            self.first_seen = True
            self._release_local_prompt()
        return step

    def _merge(self, step: SequenceOutput, out: SequenceOutput) -> None:
        if out.num_prompt_tokens:
            step.num_prompt_tokens, step.num_cached_tokens = out.num_prompt_tokens, out.num_cached_tokens
            if self.prefill is None:
                self.cached_tokens = out.num_cached_tokens
        err = finish_error(out, self.rid, self.decode.key)
        if err is not None:
            if step.token_ids:
                self.first_seen = True
                self._pending = self._fail(err, self.decode, "decode")
                step.finish_reason = None
                return
            raise self._fail(err, self.decode, "decode")
        step.token_ids.extend(out.token_ids)
        step.logprobs.extend(out.logprobs)
        step.top_logprobs.extend(out.top_logprobs)
        step.prompt_logprobs.extend(out.prompt_logprobs)
        step.prompt_top_logprobs.extend(out.prompt_top_logprobs)
        step.finish_reason = out.finish_reason

    def _on_decode_output(self, item) -> None:
        """The decode worker's stream, while Reserve / Submit or the first token (the Prefill
        call) is awaited: an error there (the decode worker died, or lost the reservation)
        cancels that call at once, rather than waiting for its timeout or for the prefill
        worker's KV hand-over to time out."""
        if (isinstance(item, BaseException) and self._decode_broken is None and not self.first_seen
                and not self.expired):       # a deadline: expire() cancels the call itself
            self._decode_broken = item
            if self._admit_call is not None:
                self._admit_call.cancel()
            elif self.prefill_call is not None:
                self.prefill_call.cancel()

    async def _first_token(self, call: PrefillStream) -> SequenceOutput:
        # A plain read of the Prefill stream: the decode stream's watch is a callback
        # (_on_decode_output), so the first token costs no extra task or loop iteration.
        try:
            step = await call.first_token()
        except grpc.aio.AioRpcError as e:
            raise self._fail(e, self._remote(), "Prefill") from e
        except asyncio.CancelledError:
            if self._decode_broken is not None:
                raise self._fail(self._decode_broken, self.decode, "output stream") from None
            if self.expired:
                raise DeadlineExceeded("deadline passed before the first token") from None
            raise
        finally:
            if type(self.queue) is OutputBuffer:
                self.queue.on_put = None
        if step is None:
            raise self._fail(Internal("Prefill stream did not start with a FirstToken"), self._remote(), "Prefill")
        self.first_seen = True
        self.cached_tokens = step.num_cached_tokens
        self._decode_load += 1
        self.decode.add_load(tokens=1)
        if step.finish_reason is not None and self.job.sampling.n == 1:
            self._release_prefill()
            self._release_lease()
            self._cancel(self.decode)          # the reservation is not needed (n > 1: the forks need it)
        else:
            self._prefill_task = asyncio.create_task(self._rest_of_prefill(call))
        return step

    async def _rest_of_prefill(self, call: PrefillStream) -> None:
        try:
            await call.finish()
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:   # after the first token: the request fails
            if self.queue is not None and not self.expired:
                self.queue.put_nowait(self._fail(e, self._remote(), "Prefill (KV transfer)"))
        finally:
            self._release_lease()            # the KV has crossed (or never will: the try fails)
            self._release_prefill()

    # ---- endings ----------------------------------------------------------------------
    def expire(self) -> None:
        """The request's deadline passed: the waiting ``next()`` raises DEADLINE_EXCEEDED."""
        self.expired = True
        if self.queue is not None:
            self.queue.put_nowait(DeadlineExceeded("deadline passed"))
        if self.prefill_call is not None and not self.first_seen:
            self.prefill_call.cancel()

    def _cancel(self, worker: WorkerClient) -> None:
        self.flow.spawn(worker.cancel(self.rid))

    def _release_prefill(self) -> None:
        if self._prefill_load and self.prefill is not None:
            self._prefill_load = False
            self.prefill.add_load(-1, prompt_tokens=-self._prefill_queued)

    def close(self, cancel_workers: bool) -> None:
        """Release everything; with ``cancel_workers`` also Cancel the request on its workers."""
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self._subscription is not None:
            self._subscription.unregister(self.rid)
            self._subscription = None
            self.decode.add_load(-1, -self._decode_load, decoding=-1)
        if self.prefill_call is not None and not self.prefill_call.done():
            self.prefill_call.cancel()
        if self._prefill_task is not None and not self._prefill_task.done():
            self._prefill_task.cancel()
        self._release_prefill()
        self._release_local_prompt()
        self._release_lease()
        if cancel_workers:
            self._cancel(self.decode)
            if self.prefill is not None:
                self._cancel(self.prefill)
