"""The decode worker's gRPC servicer: Reserve, PushKV, Submit and Subscribe over the KV import
(pdserve.decode_worker.kv_import); admission, Cancel, drain and stats are the base servicer's.

A worker of role both also serves Prefill for other workers (``export``:
pdserve.prefill_worker.export), so it receives KV (Reserve + PushKV), sends it, and prefills
locally (Submit)."""
from __future__ import annotations

import logging

from pdserve.common import telemetry
from pdserve.common.grpc_utils.convert import sampling_params_for_prompt, sequence_output_to_proto
from pdserve.common.grpc_utils.errors import FailedPrecondition, InvalidArgument
from pdserve.common.outputs import SequenceOutput
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import BaseWorkerServicer, Handoff
from pdserve.decode_worker.kv_import import KvImport
from pdserve.prefill_worker.export import KvExport
from pdserve.v1 import worker_pb2

logger = logging.getLogger(__name__)


class DecodeServicer(BaseWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, kv_import: KvImport, export: KvExport | None = None) -> None:
        sides: list[Handoff] = [kv_import] if export is None else [kv_import, export]
        super().__init__(runtime, sides)
        self.kv_import = kv_import
        self.export = export            # role both: Prefill for other workers

    def close(self) -> None:
        super().close()
        self.kv_import.close()
        if self.export is not None:
            self.export.close()

    def _admit(self, request) -> float | None:
        """The base checks plus this worker's: the request's router must be subscribed here."""
        deadline = self.admit(request.request_id, request.token_ids, request.deadline_unix_ms)
        if not self.runtime.outputs.has(request.router_id):
            raise FailedPrecondition(f"router {request.router_id!r} has no open Subscribe stream on this worker")
        return deadline

    def _params(self, request):
        return sampling_params_for_prompt(request.params, self.runtime.engine.max_model_len, len(request.token_ids))

    # ---- rpcs -------------------------------------------------------------------------------
    async def Reserve(self, request, context) -> worker_pb2.ReserveResponse:
        telemetry.bind_request(request.request_id)
        deadline = self._admit(request)
        block_ids, cached, lease_expires = await self.kv_import.reserve(
            request.request_id, list(request.token_ids), self._params(request), request.lease_ms, deadline,
            request.router_id)
        return worker_pb2.ReserveResponse(block_ids=block_ids, num_cached_tokens=cached,
                                          kv_store_address=self.kv_import.kv_store_address,
                                          worker_id=self.runtime.worker_id, lease_expires_unix_ms=lease_expires)

    async def PushKV(self, request, context) -> worker_pb2.PushKVResponse:
        telemetry.bind_request(request.request_id)
        block_ids = list(request.block_ids)
        if request.num_blocks != len(block_ids):
            raise InvalidArgument("num_blocks", f"{request.num_blocks} != len(block_ids) {len(block_ids)}")
        expected_bytes = len(block_ids) * self.runtime.engine.model_runner.block_bytes
        if request.num_bytes and request.num_bytes != expected_bytes:
            raise InvalidArgument("num_bytes", f"{request.num_bytes} != {expected_bytes} for {len(block_ids)} "
                                               f"blocks of this worker's geometry")
        if request.first_token_on_channel and not block_ids:
            raise InvalidArgument("first_token_on_channel", "needs at least one block to follow")
        await self.kv_import.push_kv(request.request_id, block_ids, request.first_token_id,
                                     request.first_token_logprob, request.prefill_worker_id, request.channel_epoch,
                                     request.first_token_on_channel, request.pair_secret)
        return worker_pb2.PushKVResponse()

    async def Submit(self, request, context) -> worker_pb2.SubmitResponse:
        telemetry.bind_request(request.request_id)
        deadline = self._admit(request)
        await self.kv_import.submit(request.request_id, list(request.token_ids), self._params(request), deadline,
                                    request.router_id)
        return worker_pb2.SubmitResponse(worker_id=self.runtime.worker_id)

    async def Prefill(self, request, context):
        if self.export is None:
            self._refuse("Prefill")
        deadline = self.admit(request.request_id, request.token_ids, request.deadline_unix_ms)
        async for msg in self.export.prefill(request, deadline):
            yield msg

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
                n = await self.kv_import.cancel_router(router_id)
                if n:
                    logger.info("router %s left: cancelled its %d requests", router_id, n)


def _merge(items: list[list[SequenceOutput]]) -> list[worker_pb2.SequenceOutput]:
    """One output per request from the steps that queued up."""
    merged: dict[str, SequenceOutput] = {}
    for outputs in items:
        for u in outputs:
            out = merged.setdefault(u.request_id, SequenceOutput(u.request_id))
            out.token_ids += u.token_ids
            out.logprobs += u.logprobs
            if u.num_prompt_tokens:
                out.num_prompt_tokens, out.num_cached_tokens = u.num_prompt_tokens, u.num_cached_tokens
            if u.finish_reason is not None:
                out.finish_reason, out.error = u.finish_reason, u.error
    return [sequence_output_to_proto(out) for out in merged.values()]
