"""Bearer tokens and TLS on real grpc.aio servers in this process: the token file (rotation, an
empty file), tokens on the public port over TLS, mutual TLS or a token on an internal port, the
internal token on every call kind, and long-lived client channels that follow rotated
credentials."""
from __future__ import annotations

import asyncio
import os
import time

import grpc
import grpc.aio
import pytest

from pdserve.common.grpc_utils import Service, build_server, client_channel
from pdserve.common.security import BearerTokens, ClientSecurity, ServerSecurity, TlsFiles
from tests.security_grpc import health, info, info_on, make_pki, serve_info


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


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
        server = serve_info(ServerSecurity(tls=TlsFiles(cert, key), tokens_file=pki["tokens"], reflection=False))
        await server.start()
        await server.set_serving(True)
        addr = f"127.0.0.1:{server.port}"
        trusting = ClientSecurity(tls=TlsFiles(ca=pki["ca"].path))
        try:
            assert await info(addr, trusting) == grpc.StatusCode.UNAUTHENTICATED
            assert await info(addr, trusting, (("authorization", "Bearer wrong"),)) == grpc.StatusCode.UNAUTHENTICATED
            assert await info(addr, trusting, (("authorization", "Bearer right-token"),)) == grpc.StatusCode.OK
            assert await info(addr, trusting, (("authorization", "Bearer second-token"),)) == grpc.StatusCode.OK
            assert await health(addr, trusting) == grpc.StatusCode.OK        # health needs no token
            # the token file as call credentials of a TLS channel
            assert await info(addr, ClientSecurity(tls=TlsFiles(ca=pki["ca"].path),
                                                    token_file=pki["tokens"])) == grpc.StatusCode.OK
            # a plaintext client, and a client that trusts another CA, cannot talk to it
            assert await health(addr, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE
            assert await health(addr, ClientSecurity(tls=TlsFiles(ca=pki["other"].path))) \
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
        server = serve_info(internal)
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        ca = pki["ca"].path
        try:
            assert await info(addr, ClientSecurity(tls=TlsFiles(*pki["client"], ca))) == grpc.StatusCode.OK
            assert await info(addr, ClientSecurity(tls=TlsFiles(ca=ca))) == grpc.StatusCode.UNAVAILABLE
            assert await info(addr, ClientSecurity(tls=TlsFiles(*pki["foreign"], ca))) == grpc.StatusCode.UNAVAILABLE
            assert await info(addr, ClientSecurity()) == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop_now()
        # plaintext internal port guarded by the internal token only
        server = serve_info(ServerSecurity(tokens_file=pki["tokens"]))
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        try:
            assert await info(addr, ClientSecurity()) == grpc.StatusCode.UNAUTHENTICATED
            assert await info(addr, ClientSecurity(token_file=pki["tokens"])) == grpc.StatusCode.OK
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


def test_client_channels_follow_rotated_credentials(pki, tmp_path):
    """Long-lived channels to workers (router -> worker, prefill -> decode) are made anew when
    the client's credential files change on disk: a rotated internal token is used without a
    restart, and a channel still holding the old one is refused once the server rotated too."""
    from pdserve.common.grpc_utils.channels import RenewingChannels
    from pdserve.common.security import set_default_client_security
    server_tokens, client_token = tmp_path / "accepted", tmp_path / "token"
    server_tokens.write_text("old-token\n")
    client_token.write_text("old-token\n")

    async def main():
        server = serve_info(ServerSecurity(tokens_file=server_tokens))
        await server.start()
        addr = f"127.0.0.1:{server.port}"
        set_default_client_security(ClientSecurity(token_file=client_token))
        channels = RenewingChannels(grace_s=0.1)
        try:
            old = channels.get(addr)
            assert await info_on(old) == grpc.StatusCode.OK and channels.get(addr) is old
            server_tokens.write_text("new-token\n")          # both Secrets updated
            client_token.write_text("new-token, longer\n")
            client_token.write_text("new-token\n")
            os.utime(client_token, ns=(time.time_ns() + 10 ** 9,) * 2)
            assert await info_on(old) == grpc.StatusCode.UNAUTHENTICATED
            new = channels.get(addr)
            assert new is not old and channels.num_renewals == 1
            assert await info_on(new) == grpc.StatusCode.OK
        finally:
            set_default_client_security(ClientSecurity())
            await channels.close()
            await server.stop_now()
    asyncio.run(main())
