"""Starting a worker process: gRPC server with health and reflection, metrics, graceful drain."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from pdserve.common.grpc_utils.deferred import Deferred
from pdserve.common.grpc_utils.server import Service, build_server, serve
from pdserve.common.security.config import ServerSecurity
from pdserve.common.serving.worker_servicer import BaseWorkerServicer, InfoServicer
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)


def start_metrics(port: int, registry=None) -> None:
    """Serve ``registry`` (default: prometheus_client's) on ``port`` (0 = off)."""
    if port:
        from prometheus_client import REGISTRY, start_http_server
        start_http_server(port, registry=registry or REGISTRY)
        logger.info("metrics on :%d/metrics", port)


async def run_worker(worker_id: str, host: str, port: int, grace_s: float,
                     build: Callable[[], Awaitable[BaseWorkerServicer]], metrics_port: int = 0,
                     security: ServerSecurity | None = None) -> None:
    """Serve Worker + InfoService until SIGTERM.

    The server answers from the start: UNAVAILABLE ("still loading its model") until ``build()``
    returns the role's servicer (model loaded, engine thread running); then health turns
    SERVING. On SIGTERM the servicer drains; after the server stopped, it closes. ``security``: the internal
    port's TLS and authentication (plaintext and open by default)."""
    loading = f"worker {worker_id} is still loading its model"
    worker = Deferred(worker_pb2.DESCRIPTOR.services_by_name["Worker"], loading)
    info = Deferred(common_pb2.DESCRIPTOR.services_by_name["InfoService"], loading)
    server = build_server(f"{host}:{port}", [
        Service(worker_pb2.DESCRIPTOR.services_by_name["Worker"], worker_pb2_grpc.add_WorkerServicer_to_server,
                worker),
        Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                common_pb2_grpc.add_InfoServiceServicer_to_server, info),
    ], security=security)
    built: list[BaseWorkerServicer] = []

    async def startup() -> None:
        servicer = await build()
        built.append(servicer)
        runtime = servicer.runtime
        runtime.metrics.stats_source = lambda: runtime.stats(servicer.num_reserved())
        start_metrics(metrics_port, runtime.metrics.registry)
        worker.bind(servicer)
        info.bind(InfoServicer(runtime))

    async def drain(grace: float) -> None:
        for servicer in built:
            await servicer.drain(grace)

    try:
        await serve(server, startup=startup, drain=drain, grace_s=grace_s)
    finally:
        for servicer in built:
            servicer.close()


def run_async(main: Coroutine[Any, Any, None]) -> int:
    try:
        asyncio.run(main)
    except KeyboardInterrupt:
        pass
    return 0
