"""The parts of the Worker and InfoService servicers that every role shares (protobuf stops here)."""
from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn

import grpc

from pdserve.common.grpc_utils.errors import FailedPrecondition
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE, "both": common_pb2.ROLE_BOTH}


def package_version() -> str:
    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "dev"


class InfoServicer(common_pb2_grpc.InfoServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    async def Info(self, request, context) -> common_pb2.ServerInfo:
        return common_pb2.ServerInfo(role=ROLES[self.runtime.role], version=package_version(),
                                     **self.runtime.info())


class BaseWorkerServicer(worker_pb2_grpc.WorkerServicer):
    """GetStats and StreamKvEvents for every role; the rest refused until a role overrides it."""

    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    def num_reserved(self) -> int:
        return 0

    def transfer_counts(self) -> tuple[int, int]:
        """(transfers, bytes) completed since start."""
        return 0, 0

    def _refuse(self, rpc: str) -> NoReturn:
        raise FailedPrecondition(f"{rpc} is not served by a worker of role {self.runtime.role}")

    async def Reserve(self, request, context):
        self._refuse("Reserve")

    async def Prefill(self, request, context):
        self._refuse("Prefill")

    async def PushKV(self, request, context):
        self._refuse("PushKV")

    async def Submit(self, request, context):
        self._refuse("Submit")

    async def Subscribe(self, request, context):
        self._refuse("Subscribe")

    async def GetStats(self, request, context) -> worker_pb2.WorkerStats:
        s = self.runtime.stats(self.num_reserved)
        transfers, nbytes = self.transfer_counts()
        return worker_pb2.WorkerStats(role=ROLES[self.runtime.role], worker_id=self.runtime.worker_id,
                                      num_kv_transfers=transfers, kv_transfer_bytes=nbytes, **s)

    async def StreamKvEvents(self, request, context):
        key = f"kv-{id(context)}"
        queue = self.runtime.kv_events.subscribe(key)
        try:
            snapshot, seq, num_blocks = await self.runtime.kv_snapshot()
            yield worker_pb2.KvEvents(stored=snapshot, snapshot=True, worker_id=self.runtime.worker_id, seq=seq,
                                      num_total_blocks=num_blocks)
            while True:
                item = await queue.get()
                if item is None:
                    return
                stored, evicted, seq = item
                yield worker_pb2.KvEvents(stored=stored, evicted=evicted, worker_id=self.runtime.worker_id, seq=seq)
        finally:
            self.runtime.kv_events.unsubscribe(key, queue)


async def wait_cancelled(context: grpc.aio.ServicerContext) -> None:
    """Await until the RPC ends (client cancellation or completion)."""
    done = asyncio.Event()
    context.add_done_callback(lambda _: done.set())
    await done.wait()
