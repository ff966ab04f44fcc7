"""The Worker and InfoService servicers' shared half (protobuf stops here and in the roles').

:class:`BaseWorkerServicer` owns what every role does the same way: admission (draining, ids,
deadline), Cancel, drain, GetStats and StreamKvEvents. A role adds its own rpcs and passes its
:class:`Handoff` sides (prefill: the KV export; decode: the KV import; both: the two).

Cancel is answered at once, off the engine's step: the id is remembered
(:class:`~pdserve.common.serving.cancels.Tombstones`, so a request the Cancel overtook is refused
when it arrives), and each side ends the request now or, when a step may be computing it, right
after that step. Its effect never depends on the Cancel rpc itself surviving (a caller's deadline).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn, Protocol

from pdserve.common.grpc_utils.convert import deadline_from_proto
from pdserve.common.grpc_utils.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

ROLES = {"prefill": common_pb2.ROLE_PREFILL, "decode": common_pb2.ROLE_DECODE, "both": common_pb2.ROLE_BOTH}
DRAIN_MARGIN_S = 1.0     # of the grace period, kept for cancelling what did not finish


class Handoff(Protocol):
    """One side of the KV handoff a role runs. Its requests end through ``cancel`` (False when
    the id is not its own); ``num_in_flight`` counts those a drain waits for."""

    def num_in_flight(self) -> int: ...

    def num_reserved(self) -> int: ...

    def transfer_counts(self) -> tuple[int, int]: ...

    async def cancel(self, request_id: str) -> bool: ...

    async def cancel_all(self) -> None: ...


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
    """Every rpc a role does not serve is refused with FAILED_PRECONDITION."""

    def __init__(self, runtime: WorkerRuntime, sides: Sequence[Handoff]) -> None:
        self.runtime = runtime
        self.sides = list(sides)
        self.draining = False

    # ---- admission ----------------------------------------------------------------------
    def admit(self, request_id: str, token_ids: Sequence[int], deadline_unix_ms: int) -> float | None:
        """Checks every new request passes; returns its deadline (Unix seconds) or None."""
        if self.draining:
            raise Unavailable(f"worker {self.runtime.worker_id} is draining")
        if not request_id:
            raise InvalidArgument("request_id", "must not be empty")
        if not token_ids:
            raise InvalidArgument("token_ids", "must not be empty")
        deadline = deadline_from_proto(deadline_unix_ms)
        if deadline is not None and deadline <= time.time():
            raise DeadlineExceeded(f"request {request_id!r} is past its deadline")
        return deadline

    def _refuse(self, rpc: str) -> NoReturn:
        raise FailedPrecondition(f"{rpc} is not served by a worker of role {self.runtime.role}")

    async def Reserve(self, request, context):
        self._refuse("Reserve")

    async def Prefill(self, request, context):
        self._refuse("Prefill")
        yield  # unreachable: makes this an async generator, as a server-streaming rpc must be

    async def PushKV(self, request, context):
        self._refuse("PushKV")

    async def Submit(self, request, context):
        self._refuse("Submit")

    async def Subscribe(self, request, context):
        self._refuse("Subscribe")
        yield  # unreachable: makes this an async generator, as a server-streaming rpc must be

    async def RenewLeases(self, request, context):
        self._refuse("RenewLeases")

    # ---- endings --------------------------------------------------------------------------
    async def Cancel(self, request, context) -> worker_pb2.CancelResponse:
        if not request.request_id:
            return worker_pb2.CancelResponse(found=False)
        self.runtime.cancelled.add(request.request_id)     # before the search: see the module doc
        found = False
        for side in self.sides:
            found = await side.cancel(request.request_id) or found
        return worker_pb2.CancelResponse(found=found)

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; let requests in flight finish for up to ``grace_s`` less a margin;
        cancel the rest; then end the output streams once what is queued for them went out."""
        self.draining = True
        deadline = time.monotonic() + max(grace_s - DRAIN_MARGIN_S, 0.0)
        while any(side.num_in_flight() for side in self.sides) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for side in self.sides:
            await side.cancel_all()
        end = time.monotonic() + DRAIN_MARGIN_S / 2     # a running request ends after its step
        while any(side.num_in_flight() for side in self.sides) and time.monotonic() < end:
            await asyncio.sleep(0.02)
        self.runtime.outputs.close_all()
        self.runtime.kv_log.subscribers.close_all()

    def close(self) -> None:
        """After the server stopped: stop the engine thread, release the role's resources."""
        self.runtime.stop()

    # ---- state ----------------------------------------------------------------------------
    def num_reserved(self) -> int:
        return sum(side.num_reserved() for side in self.sides)

    async def GetStats(self, request, context) -> worker_pb2.WorkerStats:
        counts = [side.transfer_counts() for side in self.sides]
        return worker_pb2.WorkerStats(role=ROLES[self.runtime.role], worker_id=self.runtime.worker_id,
                                      num_kv_transfers=sum(c[0] for c in counts),
                                      kv_transfer_bytes=sum(c[1] for c in counts),
                                      **self.runtime.stats(self.num_reserved()))

    async def StreamKvEvents(self, request, context):
        key = f"kv-{id(context)}"
        events = self.runtime.kv_log.subscribers
        queue = events.subscribe(key)
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
            events.unsubscribe(key, queue)

