"""pdserve.common.grpc_utils on a real grpc.aio server on a free local port (CPU, no engine).

A trivial InfoService servicer whose behaviour is switched by a class attribute lets us check
health, reflection, error mapping (domain error, ValueError, a failed downstream call, an
unexpected error; unary and streaming handlers), the message size limit, graceful shutdown and wait_ready.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc  # noqa: E402

from pdserve.common.grpc_utils import (  # noqa: E402
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PeerUnavailable,
    Service,
    Unavailable,
    build_server,
    client_channel,
    from_rpc_error,
    serve,
    unavailable_peer,
    wait_ready,
)
from pdserve.loadtest.ports import free_port
from pdserve.v1 import common_pb2, common_pb2_grpc  # noqa: E402

INFO_SERVICE = "pdserve.v1.InfoService"
SIZE_LIMIT = 64 * 1024


class InfoServicer(common_pb2_grpc.InfoServiceServicer):
    """Answers Info, or fails the way ``mode`` says."""

    mode = "ok"

    async def Info(self, request: common_pb2.InfoRequest, context: Any) -> common_pb2.ServerInfo:
        if self.mode == "invalid":
            raise InvalidArgument("params.temperature", "must be >= 0, got -1")
        if self.mode == "value_error":
            raise ValueError("max_tokens: too large")
        if self.mode == "downstream":  # an uncaught failed call to another service
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), details="worker w1 is down")
        if self.mode == "peer":        # a worker this call depended on refused
            raise PeerUnavailable("decode worker d1 refused the KV", "10.0.0.7:50051")
        if self.mode == "boom":
            raise RuntimeError("boom")
        return common_pb2.ServerInfo(protocol_version="v1", role=common_pb2.ROLE_DECODE,
                                     worker_id="w0", block_size=16)


async def _stream_tokens(request: bytes, context: Any) -> Any:
    """A server-streaming handler that yields once, then raises a domain error."""
    yield b"first"
    raise NotFound("request_id r1 is unknown")


async def _stream_past_deadline(request: bytes, context: Any) -> Any:
    """Yields once, then holds the event loop past the client's deadline (so the call ends in the
    core before the handler is cancelled) and raises the domain error of its own deadline, as a
    router whose deadline timer fires with the client's does."""
    yield b"first"
    time.sleep(0.8)
    raise DeadlineExceeded("deadline passed")


def _add_stream_handler(servicer: Any, server: grpc.aio.Server) -> None:
    """A raw (bytes in/out) server-streaming service, to test streaming error mapping."""
    handler = grpc.method_handlers_generic_handler(
        "test.Stream", {"Tokens": grpc.unary_stream_rpc_method_handler(servicer),
                        "Late": grpc.unary_stream_rpc_method_handler(_stream_past_deadline)})
    server.add_generic_rpc_handlers((handler,))


def run_with_server(body: Callable[[Any, str, grpc.aio.Channel], Awaitable[None]],
                    mode: str = "ok") -> None:
    """Start a server on a free port, run ``body(server, address, channel)``, stop it."""

    async def main() -> None:
        servicer = InfoServicer()
        servicer.mode = mode
        server = build_server(
            "127.0.0.1:0",
            [Service(INFO_SERVICE, common_pb2_grpc.add_InfoServiceServicer_to_server, servicer),
             Service("test.Stream", _add_stream_handler, _stream_tokens)],
            max_message_bytes=SIZE_LIMIT)
        await server.start()
        address = f"127.0.0.1:{server.port}"
        try:
            async with client_channel(address) as channel:
                await body(server, address, channel)
        finally:
            await server.stop_now()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


async def _health(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return reply.status


def test_health_not_serving_then_serving() -> None:
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        serving = health_pb2.HealthCheckResponse.SERVING
        assert await _health(channel) == not_serving
        assert await _health(channel, INFO_SERVICE) == not_serving
        await server.set_serving(True)
        assert await _health(channel) == serving
        assert await _health(channel, INFO_SERVICE) == serving
        await wait_ready(address, timeout=5)  # returns at once now
        await server.set_serving(False)
        assert await _health(channel, INFO_SERVICE) == not_serving

    run_with_server(body)


def test_reflection_lists_services() -> None:
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        names: set[str] = set()
        call = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        async for reply in call:
            names |= {s.name for s in reply.list_services_response.service}
        assert {INFO_SERVICE, "grpc.health.v1.Health"} <= names

    run_with_server(body)


def test_ok_call() -> None:
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        info = await common_pb2_grpc.InfoServiceStub(channel).Info(common_pb2.InfoRequest(),
                                                                   timeout=5)
        assert info.worker_id == "w0" and info.role == common_pb2.ROLE_DECODE

    run_with_server(body)


@pytest.mark.parametrize("mode, code, text", [
    ("invalid", grpc.StatusCode.INVALID_ARGUMENT, "params.temperature: must be >= 0"),
    ("value_error", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: too large"),
    ("downstream", grpc.StatusCode.UNAVAILABLE, "worker w1 is down"),
    ("boom", grpc.StatusCode.INTERNAL, "boom"),
])
def test_errors_map_to_status(mode: str, code: grpc.StatusCode, text: str,
                              caplog: pytest.LogCaptureFixture) -> None:
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await common_pb2_grpc.InfoServiceStub(channel).Info(common_pb2.InfoRequest(),
                                                                timeout=5)
        assert info.value.code() == code
        assert text in info.value.details()
        assert from_rpc_error(info.value).code == code

    with caplog.at_level("ERROR", logger="pdserve.common.grpc_utils.interceptor"):
        run_with_server(body, mode=mode)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert bool(tracebacks) == (code == grpc.StatusCode.INTERNAL)


@pytest.mark.parametrize("mode, peer", [("peer", "10.0.0.7:50051"), ("downstream", "")])
def test_unavailable_names_the_peer_at_fault(mode: str, peer: str) -> None:
    """A PeerUnavailable crosses the wire as UNAVAILABLE with its peer in the trailing metadata;
    any other UNAVAILABLE names none (the called server is at fault)."""
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await common_pb2_grpc.InfoServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert unavailable_peer(info.value) == peer

    run_with_server(body, mode=mode)


def test_streaming_error_after_first_message() -> None:
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        call = channel.unary_stream("/test.Stream/Tokens")(b"", timeout=5)
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for msg in call:
                got.append(msg)
        assert got == [b"first"]
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "r1" in info.value.details()

    run_with_server(body)


def test_error_after_the_call_ended_is_not_an_error_log(caplog: pytest.LogCaptureFixture) -> None:
    """A handler failing after its call already ended (the client's deadline passed): there is no
    one to send a status to, so the interceptor sends none and nothing logs an ERROR (gRPC
    logged "ExecuteBatchError raised in core" with a traceback when the status was sent)."""
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        call = channel.unary_stream("/test.Stream/Late")(b"", timeout=0.3)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.sleep(1.0)            # the handler wakes up and fails meanwhile
        ok = await common_pb2_grpc.InfoServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=5)
        assert ok.worker_id == "w0"         # the server serves on

    with caplog.at_level(logging.DEBUG):
        run_with_server(body)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def test_a_status_that_cannot_be_sent_ends_the_handler_as_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    """The race above when the handler's error wins it: the call has ended in gRPC's core and
    sending the status fails (gRPC's ExecuteBatchError, here a context whose abort raises as
    gRPC's does then). The interceptor ends the handler as cancelled (gRPC logs that at DEBUG)."""
    from pdserve.common.grpc_utils.interceptor import _abort

    class EndedCall:
        async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
            raise RuntimeError('Failed "execute_batch"')

    with caplog.at_level(logging.DEBUG), pytest.raises(asyncio.CancelledError):
        asyncio.run(_abort(DeadlineExceeded("deadline passed"), EndedCall(), "/pdserve.v1.Generation/Generate"))
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("DEADLINE_EXCEEDED not sent" in r.getMessage() for r in caplog.records)


def test_message_over_limit_is_rejected() -> None:
    async def body(server: Any, address: str, channel: grpc.aio.Channel) -> None:
        # Raw bytes (an InfoRequest with an unknown field would parse): the server's receive
        # limit rejects the message before deserialization.
        raw = channel.unary_unary(f"/{INFO_SERVICE}/Info")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await raw(b"\x0a" + b"x" * (SIZE_LIMIT + 1), timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Below the limit the same raw call goes through.
        assert await raw(b"", timeout=5) is not None

    run_with_server(body)


def test_wait_ready_times_out_with_unavailable() -> None:
    port = free_port()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(Unavailable) as info:
            await wait_ready(f"127.0.0.1:{port}", timeout=0.5)
        assert loop.time() - start < 3
        assert str(port) in str(info.value)

    asyncio.run(main())


def test_serve_startup_then_graceful_shutdown() -> None:
    events: list[str] = []

    async def main() -> None:
        port = free_port()
        server = build_server(
            f"127.0.0.1:{port}",
            [Service(INFO_SERVICE, common_pb2_grpc.add_InfoServiceServicer_to_server,
                     InfoServicer())])

        async def startup() -> None:
            events.append("startup")

        async def drain(grace_s: float) -> None:
            events.append(f"drain {grace_s}")
            async with client_channel(f"127.0.0.1:{port}") as ch:  # health is NOT_SERVING now
                assert await _health(ch) == health_pb2.HealthCheckResponse.NOT_SERVING

        task = asyncio.create_task(serve(server, startup=startup, drain=drain, grace_s=2.0,
                                         handle_signals=False))
        await wait_ready(f"127.0.0.1:{port}", timeout=5)
        server.request_shutdown()
        await asyncio.wait_for(task, timeout=10)

    asyncio.run(main())
    assert events == ["startup", "drain 2.0"]
