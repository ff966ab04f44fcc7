"""gRPC server and channel helpers shared by the router and the workers (grpc.aio only).

``build_server`` gives every server message size limits, the error interceptor,
``grpc.health.v1`` (NOT_SERVING until :meth:`GrpcServer.set_serving`), reflection (v1 and
v1alpha) and optional security (:mod:`pdserve.common.security`; without it a port is plaintext
and says so in the log), and with ``security.health_port`` a second, plaintext port that serves
the same health service and nothing else (for the kubelet's ``grpc:`` probes, which cannot speak
TLS): no other service, no reflection, no authentication; it stops after the main port.
``serve`` shuts down on SIGTERM/SIGINT: NOT_SERVING -> ``drain`` -> stop (a second signal stops
at once). Clients use :func:`client_channel` and :func:`wait_ready`.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from pdserve.common.grpc_utils.errors import Unavailable
from pdserve.common.grpc_utils.interceptor import ErrorInterceptor
from pdserve.common.security.config import ClientSecurity, ServerSecurity, default_client_security

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# Keepalive on both sides so idle channels and a dead router's Subscribe stream are noticed.
# ``min_reconnect_backoff_ms`` also bounds one connection attempt (chosen by experience: bench/NOTES.md).
_CLIENT_KEEPALIVE = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 5_000),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)
_SERVER_KEEPALIVE = (
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Fail loudly when the port is taken instead of silently sharing it.
    ("grpc.so_reuseport", 0),
)


def _size_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def _merge(defaults: Sequence[tuple[str, Any]], overrides: Sequence[tuple[str, Any]]
           ) -> list[tuple[str, Any]]:
    """Channel/server options, later keys winning."""
    merged = dict(defaults)
    merged.update(dict(overrides))
    return list(merged.items())


@dataclass(frozen=True)
class Service:
    """One servicer to register: its full name (or descriptor), the generated add-function."""

    name: str | ServiceDescriptor
    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any

    @property
    def full_name(self) -> str:
        return self.name if isinstance(self.name, str) else self.name.full_name


class GrpcServer:
    """A built (not yet started) grpc.aio server with its health servicer (and, optionally, the
    plaintext health-only server that shares it)."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 service_names: list[str], address: str, port: int,
                 health_server: grpc.aio.Server | None = None, health_port: int = 0) -> None:
        self.server = server
        self.health = health_servicer
        self.service_names = service_names
        self.address = address
        self.port = port  # the bound port (useful with ":0")
        self.health_server = health_server
        self.health_port = health_port  # the health-only port's bound port (0: none)
        self._shutdown = asyncio.Event()
        self._stopped = False

    async def start(self) -> None:
        """Start serving; health reports NOT_SERVING until :meth:`set_serving`."""
        await self.set_serving(False)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
        log.info("gRPC server listening on %s (port %d): %s", self.address, self.port,
                 ", ".join(self.service_names))

    async def set_serving(self, serving: bool) -> None:
        """Set the overall and every per-service health status."""
        status = SERVING if serving else NOT_SERVING
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    def request_shutdown(self) -> None:
        """Ask :func:`serve` to shut down (as SIGTERM does)."""
        self._shutdown.set()

    async def shutdown(self, grace_s: float,
                       drain: Callable[[float], Awaitable[None]] | None = None) -> None:
        """NOT_SERVING, then ``drain(grace_s)`` (bounded by grace_s), then stop with what is left."""
        if self._stopped:
            return
        self._stopped = True
        started = time.monotonic()
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(grace_s), timeout=grace_s)
            except asyncio.TimeoutError:
                log.warning("drain did not finish within %.1f s", grace_s)
            except Exception:  # noqa: BLE001 - shutdown must go on
                log.exception("drain failed")
        remaining = max(0.0, grace_s - (time.monotonic() - started))
        await self.server.stop(remaining)
        await self._stop_health()
        log.info("gRPC server on port %d stopped", self.port)

    async def stop_now(self) -> None:
        """Stop at once, cancelling every call in flight."""
        self._stopped = True
        await self.server.stop(0)
        await self._stop_health()

    async def _stop_health(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(0)


def _register_reflection_v1() -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to the default pool: v1alpha's file renamed
    (grpcio-reflection ships only v1alpha; the protos differ only in the package)."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto.FromString(reflection_pb2.DESCRIPTOR.serialized_pb)
    old, new = f".{fdp.package}.", ".grpc.reflection.v1."
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    for message in fdp.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(old, new)
    for method in fdp.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(fdp)


def enable_reflection(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Serve reflection of ``service_names`` as ``grpc.reflection.v1`` and ``v1alpha`` (one
    servicer: the messages of both versions are the same on the wire)."""
    _register_reflection_v1()
    names = [*service_names, reflection.SERVICE_NAME, REFLECTION_V1]
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}),))


def build_server(
    address: str,
    services: Sequence[Service],
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    options: Sequence[tuple[str, Any]] = (),
    security: ServerSecurity | None = None,
) -> GrpcServer:
    """Create a grpc.aio server bound to ``address`` ("host:port"; port 0 picks a free one) with
    ``services``, health, reflection (unless ``security.reflection`` is off) and ``security``;
    ``interceptors`` run inside the error and auth interceptors. Raises :class:`Unavailable`
    when the address cannot be bound.
    """
    security = security or ServerSecurity()
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(), *security.interceptors(), *interceptors],
        options=_merge([*_size_options(max_message_bytes), *_SERVER_KEEPALIVE], options),
    )
    names = [s.full_name for s in services]
    for s in services:
        s.add(s.servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if security.reflection:
        enable_reflection([*names, health.SERVICE_NAME], server)
    credentials = security.credentials()
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as e:
        raise Unavailable(f"cannot bind {address}: {e}") from e
    if port == 0:  # older grpc versions return 0 instead of raising
        raise Unavailable(f"cannot bind {address}")
    log.info("%s %s: %s; max message %d bytes", security.label, address, security.describe(),
             max_message_bytes)
    health_server, health_port = None, 0
    if security.health_port:
        health_server, health_port = _health_only_server(address, security.health_port, health_servicer)
    return GrpcServer(server, health_servicer, names, address, port, health_server, health_port)


def _health_only_server(address: str, port: int, health_servicer: health.aio.HealthServicer
                        ) -> tuple[grpc.aio.Server, int]:
    """A plaintext server on ``port`` of ``address``'s host with ``health_servicer`` alone (the
    main server's: one status for both ports)."""
    host = address.rsplit(":", 1)[0]
    server = grpc.aio.server(options=[*_size_options(64 * 1024), *_SERVER_KEEPALIVE])
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise Unavailable(f"cannot bind the health port {host}:{port}: {e}") from e
    if bound == 0:
        raise Unavailable(f"cannot bind the health port {host}:{port}")
    log.info("health port %s:%d: plaintext, grpc.health.v1 only (for probes)", host, bound)
    return server, bound


async def serve(
    server: GrpcServer,
    *,
    startup: Callable[[], Awaitable[None]] | None = None,
    drain: Callable[[float], Awaitable[None]] | None = None,
    grace_s: float = 30.0,
    handle_signals: bool = True,
) -> None:
    """Run ``server`` until SIGTERM/SIGINT (or :meth:`GrpcServer.request_shutdown`): start
    (NOT_SERVING), await ``startup()``, SERVING, then :meth:`GrpcServer.shutdown`; a second
    signal stops at once."""
    loop = asyncio.get_running_loop()
    installed: list[signal.Signals] = []
    signals_seen = 0
    stop_task: asyncio.Task[None] | None = None

    def on_signal(signum: int) -> None:
        nonlocal signals_seen, stop_task
        signals_seen += 1
        if signals_seen == 1:
            log.info("received %s: shutting down (grace %.1f s)",
                     signal.Signals(signum).name, grace_s)
            server.request_shutdown()
        else:
            log.warning("received %s again: stopping now", signal.Signals(signum).name)
            stop_task = loop.create_task(server.stop_now())

    if handle_signals:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, on_signal, sig)
                installed.append(sig)
            except (NotImplementedError, RuntimeError):  # not the main thread / platform
                log.debug("cannot install a handler for %s", sig)
    try:
        await server.start()
        if startup is not None:
            await startup()
        await server.set_serving(True)
        await server._shutdown.wait()
        await server.shutdown(grace_s, drain)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if stop_task is not None:
            await stop_task
        if not server._stopped:  # startup failed or we were cancelled
            await server.stop_now()


def client_channel(
    address: str,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
    security: ClientSecurity | None = None,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``address`` with pdserve's size limits and keepalive; ``security``
    defaults to the process's (:func:`pdserve.common.security.set_default_client_security`)."""
    security = security if security is not None else default_client_security()
    all_options = _merge([*_size_options(max_message_bytes), *_CLIENT_KEEPALIVE, *security.options()],
                         options)
    all_interceptors = [*security.interceptors(), *(interceptors or ())] or None
    credentials = security.channel_credentials()
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=all_options, interceptors=all_interceptors)
    return grpc.aio.secure_channel(address, credentials, options=all_options,
                                   interceptors=all_interceptors)


async def wait_ready(address: str, timeout: float, service: str = "",
                     poll_s: float = 0.1, security: ClientSecurity | None = None) -> None:
    """Poll ``grpc.health.v1`` at ``address`` until ``service`` ("" = overall) is SERVING; raises
    :class:`Unavailable` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    async with client_channel(address, security=security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Unavailable(f"{address} not SERVING after {timeout:.1f} s ({last})")
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                         timeout=min(remaining, 1.0), wait_for_ready=True)
                if reply.status == SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as e:
                last = f"{e.code().name}: {e.details()}"
            await asyncio.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
