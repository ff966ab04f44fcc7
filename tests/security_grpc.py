"""In-process gRPC pieces for the security unit tests: a test PKI (the deployment's CA, a
stranger's CA, server, client and foreign certificates, a token file), an Info server under a
given ``ServerSecurity``, and the status code of an Info or health call."""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.grpc_utils import GrpcServer, Service, build_server, client_channel
from pdserve.common.security import ClientSecurity, ServerSecurity
from pdserve.v1 import common_pb2, common_pb2_grpc
from tests.security_certs import CA

INFO = "/pdserve.v1.InfoService/Info"


class InfoServicer(common_pb2_grpc.InfoServiceServicer):
    """Answers every Info call with worker id ``w``."""

    async def Info(self, request, context):
        return common_pb2.ServerInfo(worker_id="w")


def make_pki(d: Path) -> dict[str, Any]:
    """Certificates and tokens written under ``d``: ``ca`` (the deployment's) issues ``server``
    and ``client``; ``other`` (a stranger's CA) issues ``foreign``; ``tokens`` holds a comment
    and two tokens, ``right-token`` and ``second-token``."""
    ca, other = CA.create(d, "deploy"), CA.create(d, "stranger")
    server = ca.issue(d, "server")
    client = ca.issue(d, "client", stem="client")
    foreign = other.issue(d, "client", stem="foreign")
    tokens = d / "tokens"
    tokens.write_text("# rotated weekly\nright-token\nsecond-token\n")
    return dict(dir=d, ca=ca, other=other, server=server, client=client, foreign=foreign, tokens=tokens)


def serve_info(security: ServerSecurity) -> GrpcServer:
    """An unstarted server on a free loopback port with the Info service under ``security``."""
    info = Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                   common_pb2_grpc.add_InfoServiceServicer_to_server, InfoServicer())
    return build_server("127.0.0.1:0", [info], security=security)


async def status_of(call: Callable[[], Awaitable[Any]]) -> grpc.StatusCode:
    """OK when awaiting ``call()`` succeeds, else the code of the RPC error it raised."""
    try:
        await call()
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


async def info_on(channel: grpc.aio.Channel, metadata=None) -> grpc.StatusCode:
    """The status of one Info call on ``channel`` (5 s deadline)."""
    stub = common_pb2_grpc.InfoServiceStub(channel)
    return await status_of(lambda: stub.Info(common_pb2.InfoRequest(), timeout=5, metadata=metadata))


async def info(address: str, security: ClientSecurity, metadata=None) -> grpc.StatusCode:
    """The status of one Info call to ``address`` on a new channel under ``security``."""
    async with client_channel(address, security=security) as ch:
        return await info_on(ch, metadata)


async def health(address: str, security: ClientSecurity) -> grpc.StatusCode:
    """The status of one health check of ``address`` on a new channel under ``security``."""
    async with client_channel(address, security=security) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return await status_of(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=5))
