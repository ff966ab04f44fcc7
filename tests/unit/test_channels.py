"""RenewingChannels against a real gRPC server that goes away and comes back at the same address:
the next call after the restart gets a fresh channel and succeeds at once, instead of failing
until the old channel's reconnect backoff ends (what made a prefill worker's PushKV to a restarted
decode worker fail)."""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.common.grpc_utils.channels import RenewingChannels
from pdserve.loadtest.ports import free_port

pytestmark = pytest.mark.timeout(60)


async def _server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


async def _check(channels: RenewingChannels, address: str) -> None:
    stub = health_pb2_grpc.HealthStub(channels.get(address))
    await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)


def test_a_peer_restarted_at_the_same_address_is_reached_at_once() -> None:
    async def scenario() -> None:
        port = free_port()
        address = f"127.0.0.1:{port}"
        channels = RenewingChannels(grace_s=0.1)
        server = await _server(port)
        await _check(channels, address)
        first = channels.get(address)
        await server.stop(None)
        for _ in range(50):            # the peer gone: calls fail and the channel backs off
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(first).Check(health_pb2.HealthCheckRequest(), timeout=1)
            if first.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                break
            await asyncio.sleep(0.05)
        assert first.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
        server = await _server(port)
        try:
            await _check(channels, address)       # no wait for the old channel's backoff
            assert channels.get(address) is not first and channels.num_reconnects == 1
        finally:
            await server.stop(None)
            await channels.close()

    asyncio.run(scenario())
