"""The prefill worker's gRPC servicer: Prefill (pdserve.prefill_worker.export: the KV shipped to
the decode worker from the step's launch, the first token streamed at once); admission, Cancel,
drain and stats are the base servicer's, which also refuses the rpcs of the other roles (Reserve,
PushKV, Submit, Subscribe) with FAILED_PRECONDITION. A Prefill request is checked as if from a
stranger (pdserve.prefill_worker.validation) before the engine sees it."""
from __future__ import annotations

from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import BaseWorkerServicer
from pdserve.prefill_worker.export import KvExport
from pdserve.prefill_worker.validation import Limits, check_prefill


class PrefillServicer(BaseWorkerServicer):
    def __init__(self, runtime: WorkerRuntime, export: KvExport) -> None:
        super().__init__(runtime, [export])
        self.export = export
        self.limits = Limits.of(runtime.engine)

    async def Prefill(self, request, context):
        deadline = self.admit(request.request_id, request.token_ids, request.deadline_unix_ms)
        check_prefill(request, self.limits)
        async for msg in self.export.prefill(request, deadline):
            yield msg

    def close(self) -> None:
        super().close()
        self.export.close()
