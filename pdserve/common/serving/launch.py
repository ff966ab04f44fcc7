"""Starting a worker process: gRPC server with health and reflection, metrics, graceful drain."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pdserve.common.grpc_utils.server import Service, build_server, serve
from pdserve.common.security.config import ServerSecurity
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.common.serving.worker_servicer import InfoServicer
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


def start_metrics(port: int, registry=None) -> None:
    """Serve ``registry`` (default: prometheus_client's) on ``port`` (0 = off)."""
    if port:
        from prometheus_client import REGISTRY, start_http_server
        start_http_server(port, registry=registry or REGISTRY)
        logger.info("metrics on :%d/metrics", port)


async def run_worker(runtime: WorkerRuntime, servicer, host: str, port: int, grace_s: float,
                     startup: Callable[[], Awaitable[None]], drain: Callable[[float], Awaitable[None]],
                     security: ServerSecurity | None = None) -> None:
    """Serve Worker + InfoService until SIGTERM; health turns SERVING once ``startup`` is done.
    ``security``: the internal port's TLS and authentication (plaintext and open by default)."""
    runtime.metrics.stats_source = lambda: runtime.stats(servicer.num_reserved)
    server = build_server(f"{host}:{port}", [
        Service(worker_pb2.DESCRIPTOR.services_by_name["Worker"], worker_pb2_grpc.add_WorkerServicer_to_server,
                servicer),
        Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                common_pb2_grpc.add_InfoServiceServicer_to_server, InfoServicer(runtime)),
    ], security=security)
    try:
        await serve(server, startup=startup, drain=drain, grace_s=grace_s)
    finally:
        runtime.stop()


def run_async(main: Coroutine[Any, Any, None]) -> int:
    try:
        asyncio.run(main)
    except KeyboardInterrupt:
        pass
    return 0
