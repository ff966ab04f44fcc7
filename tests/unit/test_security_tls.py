"""Certificates and hostile peers on real grpc.aio servers in this process: certificate reload
(a Secret update, a broken update), configuration errors, undecodable requests, and the
authenticated KV rendezvous (pair secrets) on a real TCPStore with Gloo."""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch

from pdserve.common.grpc_utils import client_channel
from pdserve.common.kv_transfer import KvStoreServer, KvTransferError, PairChannel, new_pair_secret
from pdserve.common.security import ClientSecurity, ServerSecurity, TlsFiles
from pdserve.v1 import common_pb2, common_pb2_grpc
from tests.security_certs import serial_of
from tests.security_grpc import INFO, info, make_pki, serve_info


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _served_serial(port: int, ca: Path, client: tuple[Path, Path]) -> int:
    ctx = ssl.create_default_context(cafile=str(ca))
    ctx.load_cert_chain(str(client[0]), str(client[1]))
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            return serial_of(ssl.DER_cert_to_PEM_cert(tls.getpeercert(binary_form=True)).encode())


def test_certificate_reload(pki, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    first = pki["ca"].issue(tmp_path, "server", stem="first")
    cert.write_bytes(first[0].read_bytes())
    key.write_bytes(first[1].read_bytes())

    async def main():
        server = serve_info(ServerSecurity(tls=TlsFiles(cert, key, pki["ca"].path), require_client_cert=True,
                                       accept_peer_cert=True))
        await server.start()
        ca, client = pki["ca"].path, pki["client"]
        try:
            before = await asyncio.to_thread(_served_serial, server.port, ca, client)
            assert before == serial_of(first[0].read_bytes())
            second = pki["ca"].issue(tmp_path, "server", stem="second")
            # as a Secret update does: the new files replace the old ones
            tmp_cert, tmp_key = tmp_path / "new.crt", tmp_path / "new.key"
            tmp_cert.write_bytes(second[0].read_bytes())
            tmp_key.write_bytes(second[1].read_bytes())
            os.replace(tmp_key, key)
            os.replace(tmp_cert, cert)
            after = await asyncio.to_thread(_served_serial, server.port, ca, client)
            assert after == serial_of(second[0].read_bytes()) != before
            # a broken update (key of another certificate) keeps the working certificate
            cert.write_bytes(first[0].read_bytes())
            assert await asyncio.to_thread(_served_serial, server.port, ca, client) == after
            secure_client = ClientSecurity(tls=TlsFiles(*client, ca), server_name="localhost")
            assert await info(f"127.0.0.1:{server.port}", secure_client) == grpc.StatusCode.OK
        finally:
            await server.stop_now()
    asyncio.run(main())


def test_undecodable_request_is_invalid_argument():
    async def main():
        server = serve_info(ServerSecurity())
        await server.start()
        try:
            async with client_channel(f"127.0.0.1:{server.port}") as ch:
                call = ch.unary_unary(INFO)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"\xff\xff\xff\xff\x0f", timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert "not a valid message" in e.value.details()
                ok = await common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
                assert ok.worker_id == "w"
        finally:
            await server.stop_now()
    asyncio.run(main())


def test_security_config_errors(pki, tmp_path):
    cert, key = pki["server"]
    with pytest.raises(ValueError):
        TlsFiles(cert, None)
    with pytest.raises(ValueError):
        ServerSecurity(tls=TlsFiles(cert, key), require_client_cert=True)   # no CA
    with pytest.raises(ValueError):
        TlsFiles(tmp_path / "missing.crt", key)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError):
        ServerSecurity(tokens_file=empty)


def _join(store: str, secret: str, rank: int, out: dict, timeout: float = 2.0) -> None:
    try:
        out[rank] = PairChannel(store, "p", "d", 7, rank, "cpu", timeout=timeout, secret=secret)
    except KvTransferError as e:
        out[rank] = e


def test_pair_rendezvous_needs_the_secret():
    """A stranger who reaches the decode worker's store and knows the ids and epoch, but not
    the epoch's secret, cannot become the decode worker's peer; the right sender then can."""
    secret = new_pair_secret()
    with KvStoreServer("127.0.0.1", 0, bind_host="127.0.0.1") as server:
        got: dict = {}
        decode = threading.Thread(target=_join, args=(server.local_address, secret, 1, got, 8.0))
        decode.start()
        stranger: dict = {}
        for guess in ("", new_pair_secret()):
            _join(server.address, guess, 0, stranger, timeout=1.0)
            assert isinstance(stranger[0], KvTransferError)
        assert decode.is_alive()            # still waiting for its real peer
        sender: dict = {}
        _join(server.address, secret, 0, sender, timeout=8.0)
        decode.join(10)
        assert isinstance(sender[0], PairChannel) and isinstance(got[1], PairChannel)
        data = torch.arange(16, dtype=torch.float32)
        into = torch.zeros(16)
        t = threading.Thread(target=got[1].recv, args=(into,))
        t.start()
        sender[0].send(data)
        t.join(10)
        assert torch.equal(into, data)
        assert secret not in repr(got[1]) and secret not in got[1].prefix
        sender[0].close()
        got[1].close()
