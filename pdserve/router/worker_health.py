"""A worker's health (grpc.health.v1) as the router reads it: whether it serves when the router
connects, and a watch that ends once it stops serving (SIGTERM: the worker drains). A worker
without the health service counts as serving."""
from __future__ import annotations

import logging
from collections.abc import Callable

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger(__name__)


async def not_serving(stub: health_pb2_grpc.HealthStub, timeout: float) -> str | None:
    """None when the worker's health says SERVING; else why not (for its last error)."""
    try:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout, wait_for_ready=False)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return None
        return f"health: {e.code().name}: {e.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


async def watch_until_not_serving(stub: health_pb2_grpc.HealthStub, key: str, counts: Callable[[], bool]) -> bool:
    """Watch the worker's health: True once it reports anything but SERVING while ``counts()``
    (the worker is up), False when the watch ends otherwise. The Watch call is cancelled on the
    way out (an open one would hold a draining worker's server until its grace ends)."""
    call = stub.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=False)
    try:
        async for reply in call:
            if reply.status != health_pb2.HealthCheckResponse.SERVING and counts():
                return True
    except grpc.aio.AioRpcError as e:
        log.debug("health watch of %s ended: %s", key, e.code().name)
    finally:
        call.cancel()
    return False
