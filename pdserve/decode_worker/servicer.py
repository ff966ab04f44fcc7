"""The decode worker's gRPC servicer: Reserve, PushKV, Submit and Subscribe over the KV import
(pdserve.decode_worker.kv_import); admission, Cancel, drain and stats are the base servicer's.

A worker of role both also serves Prefill for other workers (``export``:
pdserve.prefill_worker.export), so it receives KV (Reserve + PushKV), sends it, and prefills
locally (Submit).

Every request is checked as if from a stranger (pdserve.decode_worker.validation) before a block
moves; a PushKV refused for a bad field also ends its reservation, so its blocks are freed at once.
RenewLeases extends the leases of a router's reservations while their requests wait for their
prefill (the router renews them until the KV has crossed).

A router's Subscribe stream carries its requests' outputs; when it ends, or when the same router
subscribes again (it reconnected: its requests on the old stream are gone for it), the router's
requests here are cancelled. When the worker stops (the end of a drain) the stream ends after the
outputs already queued went out.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.common import telemetry
from pdserve.common.grpc_utils.convert import sampling_params_for_prompt, sequence_output_to_proto
from pdserve.common.grpc_utils.errors import FailedPrecondition, InvalidArgument
from pdserve.common.outputs import SequenceOutput
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import BaseWorkerServicer, Handoff
from pdserve.decode_worker.kv_import import KvImport
from pdserve.decode_worker.validation import check_push_kv, check_reserve, check_submit
from pdserve.prefill_worker.export import KvExport
from pdserve.prefill_worker.validation import Limits, check_prefill
from pdserve.v1 import worker_pb2

logger = logging.getLogger(__name__)


class DecodeServicer(BaseWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, kv_import: KvImport, export: KvExport | None = None) -> None:
        sides: list[Handoff] = [kv_import] if export is None else [kv_import, export]
        super().__init__(runtime, sides)
        self.kv_import = kv_import
        self.export = export            # role both: Prefill for other workers
        self.limits = Limits.of(runtime.engine)

    def close(self) -> None:
        super().close()
        self.kv_import.close()
        if self.export is not None:
            self.export.close()

    def _admit(self, request, check: Callable[..., None]) -> float | None:
        """The base checks, the request's fields (``check``), then this worker's state: the
        request's router must be subscribed here."""
        deadline = self.admit(request.request_id, request.token_ids, request.deadline_unix_ms)
        check(request, self.limits)
        if not self.runtime.outputs.has(request.router_id):
            raise FailedPrecondition(f"router {request.router_id!r} has no open Subscribe stream on this worker")
        return deadline

    def _params(self, request):
        return sampling_params_for_prompt(request.params, self.runtime.engine.max_model_len, len(request.token_ids))

    # ---- rpcs -------------------------------------------------------------------------------
    async def Reserve(self, request, context) -> worker_pb2.ReserveResponse:
        telemetry.bind_request(request.request_id)
        deadline = self._admit(request, check_reserve)
        block_ids, cached, lease_expires = await self.kv_import.reserve(
            request.request_id, list(request.token_ids), self._params(request), request.lease_ms, deadline,
            request.router_id, request.tpot_slo_ms)
        return worker_pb2.ReserveResponse(block_ids=block_ids, num_cached_tokens=cached,
                                          kv_store_address=self.kv_import.kv_store_address,
                                          worker_id=self.runtime.worker_id, lease_expires_unix_ms=lease_expires,
                                          tensor_parallel_size=self.runtime.engine_config.tensor_parallel_size)

    async def RenewLeases(self, request, context) -> worker_pb2.RenewLeasesResponse:
        if not request.router_id:
            raise InvalidArgument("router_id", "must not be empty")
        lost = await self.kv_import.renew(request.router_id, list(request.request_ids))
        return worker_pb2.RenewLeasesResponse(lost=lost)

    async def PushKV(self, request, context) -> worker_pb2.PushKVResponse:
        telemetry.bind_request(request.request_id)
        try:
            check_push_kv(request, self.limits)
        except InvalidArgument as e:
            await self.kv_import.refuse_push(request.request_id, str(e))
            raise
        await self.kv_import.push_kv(request.request_id, list(request.block_ids), request.first_token_id,
                                     request.first_token_logprob, request.prefill_worker_id, request.channel_epoch,
                                     request.first_token_on_channel, request.pair_secret,
                                     request.prefill_tensor_parallel_size or 1)
        return worker_pb2.PushKVResponse()

    async def Submit(self, request, context) -> worker_pb2.SubmitResponse:
        telemetry.bind_request(request.request_id)
        deadline = self._admit(request, check_submit)
        await self.kv_import.submit(request.request_id, list(request.token_ids), self._params(request), deadline,
                                    request.router_id, request.tpot_slo_ms)
        return worker_pb2.SubmitResponse(worker_id=self.runtime.worker_id)

    async def Prefill(self, request, context):
        if self.export is None:
            self._refuse("Prefill")
        deadline = self.admit(request.request_id, request.token_ids, request.deadline_unix_ms)
        check_prefill(request, self.limits)
        async for msg in self.export.prefill(request, deadline):
            yield msg

    async def Subscribe(self, request, context):
        if not request.router_id:
            raise InvalidArgument("router_id", "must not be empty")
        router_id = request.router_id
        if self.runtime.outputs.has(router_id):
            # the router subscribes again: it reconnected, and what it had on the old stream failed
            # on its side; nothing would ever cancel those requests here
            n = await self.kv_import.cancel_router(router_id)
            if n:
                logger.info("router %s subscribed again: cancelled its %d earlier requests", router_id, n)
        queue = self.runtime.outputs.subscribe(router_id)
        await context.send_initial_metadata(())   # tells the router the stream is open
        step = 0
        try:
            while True:
                items = [await queue.get()]
                while not queue.empty():          # coalesce steps that queued up meanwhile
                    items.append(queue.get_nowait())
                end = None in items
                items = [item for item in items if item is not None]
                if items:                         # what came before the end still goes out
                    step += 1
                    yield worker_pb2.StepOutputs(outputs=_merge(items), step=step)
                if end:
                    return
        finally:
            if self.runtime.outputs.unsubscribe(router_id, queue):
                n = await self.kv_import.cancel_router(router_id)
                if n:
                    logger.info("router %s left: cancelled its %d requests", router_id, n)


def _merge(items: list[list[SequenceOutput]]) -> list[worker_pb2.SequenceOutput]:
    """One output per request and sample from the steps that queued up."""
    merged: dict[tuple[str, int], SequenceOutput] = {}
    for outputs in items:
        for u in outputs:
            out = merged.setdefault((u.request_id, u.index), SequenceOutput(u.request_id, index=u.index))
            out.token_ids += u.token_ids
            out.logprobs += u.logprobs
            out.top_logprobs += u.top_logprobs
            out.prompt_logprobs += u.prompt_logprobs
            out.prompt_top_logprobs += u.prompt_top_logprobs
            if u.num_prompt_tokens:
                out.num_prompt_tokens, out.num_cached_tokens = u.num_prompt_tokens, u.num_cached_tokens
            if u.finish_reason is not None:
                out.finish_reason, out.error = u.finish_reason, u.error
    return [sequence_output_to_proto(out) for out in merged.values()]
