"""The prefill worker's gRPC servicer: Prefill (pdserve.prefill_worker.export: the KV shipped to the decode
worker from the step's launch, the first token streamed at once), Cancel, drain."""
from __future__ import annotations

from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import BaseWorkerServicer
from pdserve.prefill_worker.export import KvExport
from pdserve.v1 import worker_pb2


class PrefillServicer(BaseWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, export: KvExport) -> None:
        super().__init__(runtime)
        self.export = export

    def transfer_counts(self) -> tuple[int, int]:
        return self.export.transfer_counts()

    async def Prefill(self, request, context):
        async for msg in self.export.prefill(request, context):
            yield msg

    async def Cancel(self, request, context) -> worker_pb2.CancelResponse:
        return worker_pb2.CancelResponse(found=await self.export.cancel(request.request_id))

    async def drain(self, grace_s: float) -> None:
        await self.export.drain(grace_s)
