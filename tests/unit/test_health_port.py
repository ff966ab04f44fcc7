"""The plaintext health-only port (``--health-port``, ServerSecurity.health_port) beside a port
with mutual TLS, on real grpc.aio servers in this process with real certificates: a probe that
speaks as the kubelet's ``grpc:`` probe does (plaintext, ``grpc.health.v1.Health/Check``,
service "") passes while the server is SERVING and fails while it is NOT_SERVING and once it
stopped; the same probe cannot reach the TLS port; the health port serves nothing but health."""
from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.grpc_utils import Service, Unavailable, build_server, client_channel
from pdserve.common.security import ClientSecurity, ServerSecurity, TlsFiles
from pdserve.loadtest.ports import free_port
from pdserve.v1 import common_pb2, common_pb2_grpc
from tests.security_certs import CA

SERVING = health_pb2.HealthCheckResponse.SERVING


class _Info(common_pb2_grpc.InfoServiceServicer):
    async def Info(self, request, context):
        return common_pb2.ServerInfo(worker_id="w")


async def kubelet_probe(address: str, service: str = "") -> bool:
    """What the kubelet's gRPC probe does: a plaintext connection, Check(service), SERVING = pass;
    any other answer, an error or no answer within the timeout = fail."""
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=3)
        except grpc.aio.AioRpcError:
            return False
    return reply.status == SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = CA.create(d, "deploy")
    return dict(ca=ca, server=ca.issue(d, "server"), client=ca.issue(d, "client", stem="client"))


def _mtls(pki, health_port: int) -> ServerSecurity:
    cert, key = pki["server"]
    return ServerSecurity(tls=TlsFiles(cert, key, pki["ca"].path), require_client_cert=True, accept_peer_cert=True,
                          health_port=health_port)


def _server(security: ServerSecurity):
    return build_server("127.0.0.1:0", [Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                                                common_pb2_grpc.add_InfoServiceServicer_to_server, _Info())],
                        security=security)


def test_probe_passes_on_the_health_port_of_a_mutual_tls_server_and_fails_once_stopped(pki):
    async def main():
        server = _server(_mtls(pki, free_port()))
        health = f"127.0.0.1:{server.health_port}"
        main_port = f"127.0.0.1:{server.port}"
        await server.start()
        try:
            assert not await kubelet_probe(health)                  # NOT_SERVING until ready
            await server.set_serving(True)
            assert await kubelet_probe(health)
            assert await kubelet_probe(health, "pdserve.v1.InfoService")      # per-service status too
            assert not await kubelet_probe(main_port)               # the TLS port: why the health port exists
            cert, key = pki["client"]
            mtls_client = ClientSecurity(tls=TlsFiles(cert, key, pki["ca"].path))
            async with client_channel(main_port, security=mtls_client) as ch:     # the port itself still works
                assert (await common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)).worker_id
            # nothing but health on the plaintext port: no Info, no reflection
            async with grpc.aio.insecure_channel(health) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
                reflection = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in reflection(iter([b""]), timeout=5):
                        pass
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            await server.shutdown(0.5)                              # SIGTERM's path: NOT_SERVING, drain, stop
            assert not await kubelet_probe(health)                  # stopped: connection refused
        finally:
            await server.stop_now()
    asyncio.run(main())


def test_health_port_is_off_by_default_and_a_taken_one_fails_the_start(pki):
    async def main():
        server = _server(ServerSecurity())
        assert server.health_server is None and server.health_port == 0
        other = _server(_mtls(pki, free_port()))
        try:
            with pytest.raises(Unavailable, match="health port"):
                _server(_mtls(pki, other.health_port))       # bound (not started) by the other server
        finally:
            await other.stop_now()
            await server.stop_now()
    asyncio.run(main())
    with pytest.raises(ValueError, match="health port"):
        ServerSecurity(health_port=70000)


def test_health_port_flag_reaches_both_kinds_of_port(monkeypatch):
    """``--health-port`` (env PDSERVE_HEALTH_PORT) on the router's public port and a worker's internal port."""
    import argparse

    from pdserve.common.security.args import (
        add_internal_arguments,
        add_public_arguments,
        internal_server_security,
        public_server_security,
    )
    p = argparse.ArgumentParser()
    add_public_arguments(p)
    add_internal_arguments(p)
    args = p.parse_args(["--health-port", "50071"])
    assert public_server_security(args).health_port == 50071
    args.host = "127.0.0.1"
    assert internal_server_security(args).health_port == 50071
    assert p.parse_args([]).health_port == 0
    monkeypatch.setenv("PDSERVE_HEALTH_PORT", "50072")
    p = argparse.ArgumentParser()
    add_internal_arguments(p)
    assert p.parse_args([]).health_port == 50072
