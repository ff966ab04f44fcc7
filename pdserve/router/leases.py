"""The leases of one decode worker's reservations whose requests wait for their prefill: renewed
in one RenewLeases call per interval, a third of the shortest lease held (at least
MIN_RENEW_INTERVAL_S). A reservation the worker no longer holds is reported to its ``on_lost``;
a worker that does not implement RenewLeases is left alone from then on."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
import grpc.aio

log = logging.getLogger(__name__)

MIN_RENEW_INTERVAL_S = 0.05

# (request ids, timeout in s) -> the ids the worker no longer holds; raises grpc.aio.AioRpcError
Renew = Callable[[list[str], float], Awaitable[list[str]]]


class LeaseKeeper:
    """The renewing task of one decode worker (``key``), running while a lease is held;
    ``timeout_s`` is the shortest wait for a RenewLeases answer."""

    def __init__(self, key: str, renew: Renew, timeout_s: float) -> None:
        self.key = key
        self.renew = renew
        self.timeout_s = timeout_s
        self.held: dict[str, tuple[float, Callable[[str], None]]] = {}   # id -> (lease s, on_lost)
        self.supported = True
        self._task: asyncio.Task | None = None

    def hold(self, request_id: str, lease_s: float, on_lost: Callable[[str], None]) -> None:
        if not self.supported:
            return
        self.held[request_id] = (lease_s, on_lost)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"leases-{self.key}")

    def release(self, request_id: str) -> None:
        self.held.pop(request_id, None)

    def close(self) -> None:
        self.held.clear()
        if self._task is not None:
            self._task.cancel()

    def _interval(self) -> float:
        return max(MIN_RENEW_INTERVAL_S, min(lease for lease, _ in self.held.values()) / 3)

    async def _run(self) -> None:
        while self.held:
            await asyncio.sleep(self._interval())
            if not self.held:
                return
            try:
                lost = await self.renew(list(self.held), max(self.timeout_s, self._interval()))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:    # a worker without leases to renew
                    log.info("worker %s does not renew leases (%s)", self.key, e.details())
                    self.supported = False
                    self.held.clear()
                    return
                log.debug("RenewLeases on %s failed: %s", self.key, e.code().name)
                continue
            for rid in lost:
                entry = self.held.pop(rid, None)
                if entry is not None:
                    entry[1](f"decode worker {self.key} no longer holds the reservation of {rid} "
                             "(its lease could not be kept)")
