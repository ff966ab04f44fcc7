"""The prefill worker's gRPC servicer: Prefill (pdserve.prefill_worker.export: the KV shipped to
the decode worker from the step's launch, the first token streamed at once); admission, Cancel,
drain and stats are the base servicer's."""
from __future__ import annotations

from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import BaseWorkerServicer
from pdserve.prefill_worker.export import KvExport


class PrefillServicer(BaseWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, export: KvExport) -> None:
        super().__init__(runtime, [export])
        self.export = export

    async def Prefill(self, request, context):
        deadline = self.admit(request.request_id, request.token_ids, request.deadline_unix_ms)
        async for msg in self.export.prefill(request, deadline):
            yield msg

    def close(self) -> None:
        super().close()
        self.export.close()
