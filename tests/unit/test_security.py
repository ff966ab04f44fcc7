"""Transport security and authentication on real grpc.aio servers in this process: real TLS
certificates (a CA made here), bearer tokens, mutual TLS, certificate reload, undecodable
requests, and the authenticated KV rendezvous (pair secrets) on a real TCPStore with Gloo."""
from __future__ import annotations

import asyncio
import os
import socket
import ssl
import threading
import time
from pathlib import Path

import grpc
import grpc.aio
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.common.grpc_utils import Service, build_server, client_channel
from pdserve.common.kv_transfer import KvStoreServer, KvTransferError, PairChannel, new_pair_secret
from pdserve.common.security import BearerTokens, ClientSecurity, ServerSecurity, TlsFiles
from pdserve.v1 import common_pb2, common_pb2_grpc
from tests.security_certs import CA, serial_of

INFO = "/pdserve.v1.InfoService/Info"


class _Info(common_pb2_grpc.InfoServiceServicer):
    async def Info(self, request, context):
        return common_pb2.ServerInfo(worker_id="w")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other = CA.create(d, "deploy"), CA.create(d, "stranger")
    server = ca.issue(d, "server")
    client = ca.issue(d, "client", stem="client")
    foreign = other.issue(d, "client", stem="foreign")
    tokens = d / "tokens"
    tokens.write_text("# rotated weekly\nright-token\nsecond-token\n")
    return dict(dir=d, ca=ca, other=other, server=server, client=client, foreign=foreign, tokens=tokens)


def _serve(security: ServerSecurity):
    server = build_server("127.0.0.1:0", [Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                                                  common_pb2_grpc.add_InfoServiceServicer_to_server, _Info())],
                          security=security)
    return server


async def _info(address: str, security: ClientSecurity, metadata=None) -> grpc.StatusCode:
    async with client_channel(address, security=security) as ch:
        try:
            await common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5, metadata=metadata)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


async def _health(address: str, security: ClientSecurity) -> grpc.StatusCode:
    async with client_channel(address, security=security) as ch:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()


def test_bearer_tokens(tmp_path):
    f = tmp_path / "t"
    f.write_text("alpha\n\n# comment\nbeta\n")
    t = BearerTokens.from_file(f)
    assert len(t) == 2 and t.first_token() == "alpha"
    assert t.check("Bearer alpha") and t.check("bearer beta") and t.check("Bearer  beta ")
    for bad in (None, "", "alpha", "Bearer", "Bearer alph", "Bearer alphaa", "Basic alpha", "Bearer " + "x" * 5000):
        assert not t.check(bad), bad
    time.sleep(0.01)
    f.write_text("gamma\n")            # rotated: re-read on the next check
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert t.check("Bearer gamma") and not t.check("Bearer alpha")
    f.write_text("")                    # an empty file keeps the old tokens
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 2 * 10**9))
    assert t.check("Bearer gamma")
    with pytest.raises(ValueError):
        BearerTokens.from_file(tmp_path / "missing")


def test_public_tls_and_tokens(pki):
    async def main():
        cert, key = pki["server"]
        server = _serve(ServerSecurity(tls=TlsFiles(cert, key), tokens_file=pki["tokens"], reflection=False))
        await server.start()
        await server.set_serving(True)
        addr = f"127.0.0.1:{server.port}"
        trusting = ClientSecurity(tls=TlsFiles(ca=pki["ca"].path))
        try:
            assert await _info(addr, trusting) == grpc.StatusCode.UNAUTHENTICATED
            assert await _info(addr, trusting, (("authorization", "Bearer wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
            assert await _info(addr, trusting, (("authorization", "Bearer right-token"),)) == grpc.StatusCode.OK
            assert await _info(addr, trusting, (("authorization", "Bearer second-token"),)) == grpc.StatusCode.OK
            assert await _health(addr, trusting) == grpc.StatusCode.OK        # health needs no token
            # the token file as call credentials of a TLS channel
            assert await _info(addr, ClientSecurity(tls=TlsFiles(ca=pki["ca"].path),
                                                    token_file=pki["tokens"])) == grpc.StatusCode.OK
            # a plaintext client, and a client that trusts another CA, cannot talk to it
            assert await _health(addr, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE
            assert await _health(addr, ClientSecurity(tls=TlsFiles(ca=pki["other"].path))) \
                == grpc.StatusCode.UNAVAILABLE
            # reflection turned off
            async with client_channel(addr, security=trusting) as ch:
                call = ch.unary_unary("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call(b"", timeout=5, metadata=(("authorization", "Bearer right-token"),))
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop_now()
    asyncio.run(main())


def test_internal_mtls_and_token(pki):
    async def main():
        cert, key = pki["server"]
        internal = ServerSecurity(tls=TlsFiles(cert, key, pki["ca"].path), require_client_cert=True,
                                  accept_peer_cert=True)
        server = _serve(internal)
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        ca = pki["ca"].path
        try:
            assert await _info(addr, ClientSecurity(tls=TlsFiles(*pki["client"], ca))) == grpc.StatusCode.OK
            assert await _info(addr, ClientSecurity(tls=TlsFiles(ca=ca))) == grpc.StatusCode.UNAVAILABLE
            assert await _info(addr, ClientSecurity(tls=TlsFiles(*pki["foreign"], ca))) == grpc.StatusCode.UNAVAILABLE
            assert await _info(addr, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop_now()
        # plaintext internal port guarded by the internal token only
        server = _serve(ServerSecurity(tokens_file=pki["tokens"]))
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        try:
            assert await _info(addr, ClientSecurity()) == grpc.StatusCode.UNAUTHENTICATED
            assert await _info(addr, ClientSecurity(token_file=pki["tokens"])) == grpc.StatusCode.OK
        finally:
            await server.stop_now()
    asyncio.run(main())


ECHO = "pdserve.test.Echo"
CALL_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


async def _check_caller(context) -> None:
    """The caller's own metadata arrives beside the token."""
    if ("x-caller", "kept") not in tuple(context.invocation_metadata()):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the caller's metadata was lost")


async def _echo_unary(request: bytes, context) -> bytes:
    await _check_caller(context)
    return request


async def _echo_unary_stream(request: bytes, context):
    await _check_caller(context)
    for _ in range(2):
        yield request


async def _echo_stream_unary(requests, context) -> bytes:
    await _check_caller(context)
    return b"".join([r async for r in requests])


async def _echo_stream_stream(requests, context):
    await _check_caller(context)
    async for r in requests:
        yield r


def _add_echo(servicer, server: grpc.aio.Server) -> None:
    """One method of each call kind, on raw bytes (no serializers)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(ECHO, {
        "unary_unary": grpc.unary_unary_rpc_method_handler(_echo_unary),
        "unary_stream": grpc.unary_stream_rpc_method_handler(_echo_unary_stream),
        "stream_unary": grpc.stream_unary_rpc_method_handler(_echo_stream_unary),
        "stream_stream": grpc.stream_stream_rpc_method_handler(_echo_stream_stream),
    }),))


async def _requests():
    for part in (b"a", b"b"):
        yield part


async def _call_kind(channel: grpc.aio.Channel, kind: str) -> grpc.StatusCode:
    """One call of ``kind`` on ``channel``, read to its end (with a caller's own metadata)."""
    method = getattr(channel, kind)(f"/{ECHO}/{kind}")
    md = (("x-caller", "kept"),)
    try:
        if kind == "unary_unary":
            assert await method(b"x", timeout=5, metadata=md) == b"x"
        elif kind == "unary_stream":
            assert [r async for r in method(b"x", timeout=5, metadata=md)] == [b"x", b"x"]
        elif kind == "stream_unary":
            assert await method(_requests(), timeout=5, metadata=md) == b"ab"
        else:
            assert [r async for r in method(_requests(), timeout=5, metadata=md)] == [b"a", b"b"]
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        return e.code()


async def _refused_code(channel: grpc.aio.Channel, kind: str) -> grpc.StatusCode:
    """The status of a call of ``kind`` that writes no stream message (a write racing a refusal
    can turn its status into INTERNAL on the client: grpc/grpc#36066)."""
    method = getattr(channel, kind)(f"/{ECHO}/{kind}")
    call = method(b"x", timeout=5) if kind.startswith("unary") else method(timeout=5)
    return await call.code()


async def _kinds(address: str, security: ClientSecurity, refused: bool = False) -> dict[str, grpc.StatusCode]:
    async with client_channel(address, security=security) as ch:
        return {kind: await (_refused_code(ch, kind) if refused else _call_kind(ch, kind)) for kind in CALL_KINDS}


@pytest.mark.parametrize("transport", ["plaintext", "tls"])
def test_internal_token_reaches_every_call_kind(pki, transport):
    """The client side sends the internal token on unary-unary, unary-stream (Subscribe,
    Prefill, StreamKvEvents), stream-unary and stream-stream calls alike: by interceptors on a
    plaintext channel, as call credentials on a TLS one; without it each kind is refused."""
    async def main():
        cert, key = pki["server"]
        tls = TlsFiles(cert, key) if transport == "tls" else None
        server = build_server("127.0.0.1:0", [Service(ECHO, _add_echo, None)],
                              security=ServerSecurity(tls=tls, tokens_file=pki["tokens"], reflection=False))
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        client_tls = TlsFiles(ca=pki["ca"].path) if transport == "tls" else None
        try:
            assert await _kinds(addr, ClientSecurity(tls=client_tls, token_file=pki["tokens"])) \
                == dict.fromkeys(CALL_KINDS, grpc.StatusCode.OK)
            assert await _kinds(addr, ClientSecurity(tls=client_tls), refused=True) \
                == dict.fromkeys(CALL_KINDS, grpc.StatusCode.UNAUTHENTICATED)
        finally:
            await server.stop_now()
    asyncio.run(main())


def test_token_interceptors_one_per_call_kind():
    """grpc.aio files an interceptor under the first kind it is an instance of; each of ours is
    an instance of exactly one, so each kind gets its own."""
    from pdserve.common.security.auth import token_client_interceptors
    kinds = (grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
             grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor)
    interceptors = token_client_interceptors("t")
    assert [[isinstance(i, k) for k in kinds].count(True) for i in interceptors] == [1, 1, 1, 1]
    assert all(any(isinstance(i, k) for i in interceptors) for k in kinds)


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
        server = _serve(ServerSecurity(tls=TlsFiles(cert, key, pki["ca"].path), require_client_cert=True,
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
            assert await _info(f"127.0.0.1:{server.port}", secure_client) == grpc.StatusCode.OK
        finally:
            await server.stop_now()
    asyncio.run(main())


def test_undecodable_request_is_invalid_argument():
    async def main():
        server = _serve(ServerSecurity())
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


def test_client_channels_follow_rotated_credentials(pki, tmp_path):
    """Long-lived channels to workers (router -> worker, prefill -> decode) are made anew when
    the client's credential files change on disk: a rotated internal token is used without a
    restart, and a channel still holding the old one is refused once the server rotated too."""
    from pdserve.common.grpc_utils.channels import RenewingChannels
    from pdserve.common.security import set_default_client_security
    server_tokens, client_token = tmp_path / "accepted", tmp_path / "token"
    server_tokens.write_text("old-token\n")
    client_token.write_text("old-token\n")

    async def call(channel) -> grpc.StatusCode:
        try:
            await common_pb2_grpc.InfoServiceStub(channel).Info(common_pb2.InfoRequest(), timeout=5)
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    async def main():
        server = _serve(ServerSecurity(tokens_file=server_tokens))
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        set_default_client_security(ClientSecurity(token_file=client_token))
        channels = RenewingChannels(grace_s=0.1)
        try:
            old = channels.get(addr)
            assert await call(old) == grpc.StatusCode.OK and channels.get(addr) is old
            server_tokens.write_text("new-token\n")          # both Secrets updated
            client_token.write_text("new-token, longer\n")
            client_token.write_text("new-token\n")
            os.utime(client_token, ns=(time.time_ns() + 10 ** 9,) * 2)
            assert await call(old) == grpc.StatusCode.UNAUTHENTICATED
            new = channels.get(addr)
            assert new is not old and channels.num_renewals == 1
            assert await call(new) == grpc.StatusCode.OK
        finally:
            set_default_client_security(ClientSecurity())
            await channels.close()
            await server.stop_now()
    asyncio.run(main())


# ---- pdserve up: the deployment's security ---------------------------------------------------

def _up(*flags: str):
    from pdserve import cli
    return cli.build_parser().parse_args(["up", *flags])


def _value(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


def test_up_passes_security_flags_by_role(pki):
    """Every service gets the internal flags (a worker: its port and its channels to other
    workers; the router: its channels to workers), the router also the public tokens; user extras
    come after them; up's own calls use each port's credentials."""
    from pdserve.cli import cmd_up
    cert, key = pki["server"]
    args = _up("--internal-token-file", str(pki["tokens"]), "--internal-tls-cert", str(cert),
               "--internal-tls-key", str(key), "--internal-tls-ca", str(pki["ca"].path),
               "--internal-tls-server-name", "pdserve-internal", "--auth-tokens-file", str(pki["tokens"]),
               "--extra-router-args=--reflection off")
    *workers, router = cmd_up.plan(args)
    internal = {"--internal-token-file": str(pki["tokens"]), "--internal-tls-cert": str(cert),
                "--internal-tls-key": str(key), "--internal-tls-ca": str(pki["ca"].path),
                "--internal-tls-server-name": "pdserve-internal"}
    for child in (*workers, router):
        assert {flag: _value(child.cmd, flag) for flag in internal} == internal, child.name
    assert all("--auth-tokens-file" not in w.cmd for w in workers)
    assert _value(router.cmd, "--auth-tokens-file") == str(pki["tokens"])
    assert router.cmd.index("--reflection") > router.cmd.index("--auth-tokens-file")     # extras win
    assert all(w.client.tls is not None and w.client.server_name == "pdserve-internal" for w in workers)
    assert router.client.tls is None and router.client.token_file == pki["tokens"]     # the public port
    plain = cmd_up.plan(_up("--no-internal-auth"))
    assert not [f for c in plain for f in c.cmd if f.startswith(("--internal-", "--auth-tokens"))]


def test_up_makes_a_token_per_deployment(pki):
    """Without internal credentials `up` makes a random token (a 0600 file in a 0700 directory,
    removed at the end) that every service gets by its path, never on a command line; not with
    --no-internal-auth, nor when mutual TLS is given."""
    from pdserve.cli import cmd_up
    from pdserve.common.security.deployment import deployment_security
    args = _up()
    with deployment_security(args) as first, deployment_security(args) as second:
        path = first.token_file
        assert path is not None and second.token_file is not None
        token = path.read_text().strip()
        assert len(token) >= 32 and token != second.token_file.read_text().strip()
        assert (path.stat().st_mode & 0o777, path.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        children = cmd_up.plan(args, first)
        assert all(_value(c.cmd, "--internal-token-file") == str(path) for c in children)
        assert not [c for c in children if any(token in part for part in c.cmd)]
        assert children[0].client.token_file == path and children[-1].client.token_file is None
    assert not path.exists() and not path.parent.exists()
    with deployment_security(_up("--no-internal-auth")) as off:
        assert off.token_file is None and not off.internal_auth
    cert, key = pki["server"]
    with deployment_security(_up("--internal-tls-cert", str(cert), "--internal-tls-key", str(key),
                                 "--internal-tls-ca", str(pki["ca"].path))) as mtls:
        assert mtls.token_file is None and mtls.tls is not None


def test_up_security_flag_errors(pki, tmp_path):
    from pdserve.common.security.deployment import DeploymentSecurity
    cert, key = pki["server"]
    for flags in (["--no-internal-auth", "--internal-token-file", str(pki["tokens"])],
                  ["--no-internal-auth", "--internal-tls-cert", str(cert), "--internal-tls-key", str(key),
                   "--internal-tls-ca", str(pki["ca"].path)],
                  ["--internal-tls-cert", str(cert), "--internal-tls-key", str(key)],
                  ["--internal-tls-server-name", "x"],
                  ["--internal-token-file", str(tmp_path / "missing")],
                  ["--auth-tokens-file", str(tmp_path / "missing")]):
        with pytest.raises(ValueError):
            DeploymentSecurity.from_args(_up(*flags))


def test_open_internal_port_beyond_loopback_warns_once(pki, caplog):
    import argparse
    import logging

    from pdserve.common.security.args import add_internal_arguments, internal_server_security
    parser = argparse.ArgumentParser()
    parser.add_argument("--host")
    add_internal_arguments(parser)

    def warnings(*flags: str) -> int:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="pdserve.common.security.args"):
            internal_server_security(parser.parse_args(list(flags)))
        return len([r for r in caplog.records if r.levelno == logging.WARNING])

    assert warnings("--host", "0.0.0.0") == 1
    assert warnings("--host", "10.1.2.3") == 1
    assert warnings("--host", "127.0.0.1") == warnings("--host", "localhost") == warnings("--host", "::1") == 0
    assert warnings("--host", "0.0.0.0", "--internal-token-file", str(pki["tokens"])) == 0
