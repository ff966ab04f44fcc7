"""The decode worker's gRPC servicer: validate -> convert -> call the engine thread -> convert.

A worker of role both also serves Prefill for other workers (``export``: pdserve.prefill_worker.export),
so it receives KV (Reserve + PushKV), sends it, and prefills locally (Submit)."""
from __future__ import annotations

import asyncio
import logging
import time

from pdserve.common import telemetry
from pdserve.common.engine.llm_engine import DuplicateRequest, OutOfBlocks
from pdserve.common.grpc_utils.convert import deadline_from_proto, finish_reason_to_proto, sampling_params_for_prompt
from pdserve.common.grpc_utils.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from pdserve.common.kv_transfer import KvTransferError
from pdserve.common.outputs import SequenceOutput
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import BaseWorkerServicer
from pdserve.decode_worker.state import BadTransfer, DecodeState, NoSuchRequest, resolve_receive
from pdserve.prefill_worker.export import KvExport
from pdserve.v1 import worker_pb2

logger = logging.getLogger(__name__)


class DecodeServicer(BaseWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, state: DecodeState, kv_store_address: str, receiver,
                 export: KvExport | None = None) -> None:
        super().__init__(runtime)
        self.state = state
        self.kv_store_address = kv_store_address
        self.receiver = receiver
        self.export = export            # role both: Prefill for other workers
        self.draining = False

    def num_reserved(self) -> int:
        return self.state.num_reserved()

    def transfer_counts(self) -> tuple[int, int]:
        """Received, plus sent for a worker of role both."""
        sent = self.export.transfer_counts() if self.export is not None else (0, 0)
        return self.state.num_transfers + sent[0], self.state.transfer_bytes + sent[1]

    # ---- checks shared by Reserve and Submit ------------------------------------------------
    def _admission_checks(self, request_id: str, router_id: str, token_ids, deadline_unix_ms: int) -> float | None:
        if self.draining:
            raise Unavailable(f"worker {self.runtime.worker_id} is draining")
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if not token_ids:
            raise InvalidArgument("token_ids", "must not be empty")
        if not self.runtime.outputs.has(router_id):
            raise FailedPrecondition(f"router {router_id!r} has no open Subscribe stream on this worker")
        deadline = deadline_from_proto(deadline_unix_ms)
        if deadline is not None and deadline <= time.time():
            raise DeadlineExceeded(f"request {request_id!r} is past its deadline")
        return deadline

    def _params(self, request):
        return sampling_params_for_prompt(request.params, self.runtime.engine.max_model_len, len(request.token_ids))

    async def _call(self, fn):
        try:
            return await self.runtime.call(fn)
        except OutOfBlocks as e:
            raise ResourceExhausted(str(e)) from e
        except DuplicateRequest as e:
            raise AlreadyExists(str(e)) from e
        except NoSuchRequest as e:
            raise NotFound(str(e.args[0])) from e
        except BadTransfer as e:
            raise FailedPrecondition(str(e)) from e

    # ---- rpcs -------------------------------------------------------------------------------
    async def Reserve(self, request, context) -> worker_pb2.ReserveResponse:
        telemetry.bind_request(request.request_id)
        deadline = self._admission_checks(request.request_id, request.router_id, request.token_ids,
                                          request.deadline_unix_ms)
        params = self._params(request)
        block_ids, cached = await self._call(lambda e: self.state.reserve(
            e, request.request_id, list(request.token_ids), params, request.lease_ms, deadline, request.router_id))
        lease_ms = request.lease_ms or self.state.default_lease_ms
        return worker_pb2.ReserveResponse(block_ids=block_ids, num_cached_tokens=cached,
                                          kv_store_address=self.kv_store_address, worker_id=self.runtime.worker_id,
                                          lease_expires_unix_ms=int(time.time() * 1000) + lease_ms)

    async def PushKV(self, request, context) -> worker_pb2.PushKVResponse:
        telemetry.bind_request(request.request_id)
        block_ids = list(request.block_ids)
        if request.num_blocks != len(block_ids):
            raise InvalidArgument("num_blocks", f"{request.num_blocks} != len(block_ids) {len(block_ids)}")
        expected_bytes = len(block_ids) * self.runtime.engine.model_runner.block_bytes
        if request.num_bytes and request.num_bytes != expected_bytes:
            raise InvalidArgument("num_bytes", f"{request.num_bytes} != {expected_bytes} for {len(block_ids)} "
                                               f"blocks of this worker's geometry")
        on_channel = request.first_token_on_channel
        if on_channel and not block_ids:
            raise InvalidArgument("first_token_on_channel", "needs at least one block to follow")
        rid, first, lp = request.request_id, request.first_token_id, request.first_token_logprob
        await self._call(lambda e: self.state.start_receive(e, rid, block_ids))
        if not block_ids:
            self.runtime.loop.call(lambda e: self.state.finish_receive(e, rid, first, lp, None, None))
            return worker_pb2.PushKVResponse()
        try:
            future = self.receiver.post(request.prefill_worker_id, request.channel_epoch, block_ids,
                                        with_first_token=on_channel, secret=request.pair_secret)
        except KvTransferError as e:   # nothing was posted: the reservation ends here
            self.runtime.metrics.kv_failures.labels("recv").inc()
            err = e     # Python unbinds ``e`` when this block ends, before the engine thread runs
            self.runtime.loop.call(lambda eng: self.state.finish_receive(eng, rid, first, lp, None, err))
            raise FailedPrecondition(str(e)) from e
        future.add_done_callback(self.runtime.metrics.watch_receive(rid))
        future.add_done_callback(lambda f: resolve_receive(self.runtime.loop, self.state, rid, first, lp, f))
        return worker_pb2.PushKVResponse()

    async def Submit(self, request, context) -> worker_pb2.SubmitResponse:
        telemetry.bind_request(request.request_id)
        deadline = self._admission_checks(request.request_id, request.router_id, request.token_ids,
                                          request.deadline_unix_ms)
        params = self._params(request)
        await self._call(lambda e: self.state.submit(e, request.request_id, list(request.token_ids), params,
                                                     deadline, request.router_id))
        return worker_pb2.SubmitResponse(worker_id=self.runtime.worker_id)

    async def Prefill(self, request, context):
        if self.export is None:
            self._refuse("Prefill")
        async for msg in self.export.prefill(request, context):
            yield msg

    async def Cancel(self, request, context) -> worker_pb2.CancelResponse:
        found = await self.runtime.call(lambda e: self.state.cancel(e, request.request_id))
        if not found and self.export is not None:
            found = await self.export.cancel(request.request_id)
        return worker_pb2.CancelResponse(found=found)

    async def Subscribe(self, request, context):
        if not request.router_id:
            raise InvalidArgument("router_id", "must not be empty")
        router_id = request.router_id
        queue = self.runtime.outputs.subscribe(router_id)
        await context.send_initial_metadata(())   # tells the router the stream is open
        step = 0
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():          # coalesce steps that queued up meanwhile
                    items.append(queue.get_nowait())
                if any(item is None for item in items):
                    return
                step += 1
                yield worker_pb2.StepOutputs(outputs=_merge(items), step=step)
        finally:
            if self.runtime.outputs.unsubscribe(router_id, queue):
                n = await self.runtime.call(lambda e: self.state.cancel_router(e, router_id))
                if n:
                    logger.info("router %s left: cancelled its %d requests", router_id, n)

    # ---- shutdown ---------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        """Stop admitting; let in-flight requests finish for up to ``grace_s``; cancel the rest."""
        self.draining = True
        if self.export is not None:
            await self.export.drain(grace_s)
        deadline = time.monotonic() + max(grace_s - 1.0, 0.0)
        while self.state.tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await self.runtime.call(lambda e: [self.state.cancel(e, rid) for rid in list(self.state.tracked)])


def _merge(items: list[list[SequenceOutput]]) -> list[worker_pb2.SequenceOutput]:
    merged: dict[str, worker_pb2.SequenceOutput] = {}
    for updates in items:
        for u in updates:
            out = merged.get(u.request_id)
            if out is None:
                out = merged[u.request_id] = worker_pb2.SequenceOutput(request_id=u.request_id)
            out.token_ids.extend(u.token_ids)
            out.logprobs.extend(u.logprobs)
            if u.num_prompt_tokens:
                out.num_prompt_tokens, out.num_cached_tokens = u.num_prompt_tokens, u.num_cached_tokens
            if u.finish_reason is not None:
                out.finish_reason = finish_reason_to_proto(u.finish_reason)
                out.error = u.error
    return list(merged.values())
