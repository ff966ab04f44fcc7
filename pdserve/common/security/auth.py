"""Who may call: the server interceptor that checks bearer tokens (or a verified client
certificate) before every handler, and the client side that sends a token. ``grpc.health.v1``
stays open (probes carry no token); everyone else without credentials gets UNAUTHENTICATED.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from pdserve.common.security.tokens import BearerTokens

log = logging.getLogger(__name__)

AUTHORIZATION = "authorization"
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)


def _authorization(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION:
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return None


def has_peer_certificate(context: grpc.aio.ServicerContext) -> bool:
    """Whether the caller's TLS connection presented a verified client certificate."""
    try:
        auth = context.auth_context()
    except Exception:  # noqa: BLE001 - no auth context: plaintext
        return False
    return bool(auth.get("x509_pem_cert")) and context.peer_identities() is not None


def _guard(behavior: Callable[..., Any], allowed: Callable[[Any], bool], streaming: bool,
           message: str) -> Callable[..., Any]:
    """``behavior`` behind ``allowed(context)`` (aborting UNAUTHENTICATED when it says no)."""
    if streaming and (inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior)):

        async def gen(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not allowed(context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            stream = behavior(request, context)
            if inspect.isasyncgen(stream):
                async for item in stream:
                    yield item
            else:
                for item in stream:
                    yield item

        return gen

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if not allowed(context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        result = behavior(request, context)
        return await result if inspect.isawaitable(result) else result

    return call


def _rebuild(handler: grpc.RpcMethodHandler, allowed: Callable[[Any], bool],
             message: str) -> grpc.RpcMethodHandler:
    # A caller refused outright does not get its request parsed.
    deserializer = _skip if allowed is _refuse else handler.request_deserializer
    kwargs = dict(request_deserializer=deserializer,
                  response_serializer=handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(
            _guard(handler.unary_unary, allowed, False, message), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(
            _guard(handler.stream_unary, allowed, False, message), **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _guard(handler.unary_stream, allowed, True, message), **kwargs)
    return grpc.stream_stream_rpc_method_handler(
        _guard(handler.stream_stream, allowed, True, message), **kwargs)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer ``tokens`` (None: none accepted) and/or, with ``accept_peer_cert``, verified client
    certificates in front of every method; with neither every guarded call is refused."""

    def __init__(self, tokens: BearerTokens | None, accept_peer_cert: bool = False,
                 open_prefixes: Sequence[str] = OPEN_METHOD_PREFIXES) -> None:
        self.tokens = tokens
        self.accept_peer_cert = accept_peer_cert
        self.open_prefixes = tuple(open_prefixes)
        what = " or ".join(w for w, on in (("a valid bearer token", tokens is not None),
                                            ("a client certificate of the deployment's CA",
                                             accept_peer_cert)) if on)
        self.message = f"this call needs {what or 'credentials'}"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = details.method
        if method.startswith(self.open_prefixes):
            return await continuation(details)
        if self.tokens is not None and self.tokens.check(_authorization(details.invocation_metadata)):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return handler
        if self.accept_peer_cert:
            allowed: Callable[[Any], bool] = has_peer_certificate
        else:
            allowed = _refuse
        log.debug("%s: no accepted token; %s", method,
                  "checking the client certificate" if self.accept_peer_cert else "refused")
        return _rebuild(handler, allowed, self.message)


def _refuse(context: Any) -> bool:
    return False


def _skip(data: bytes) -> None:
    return None


def _with_token(details: grpc.aio.ClientCallDetails, value: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(AUTHORIZATION, value)
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


class _TokenInterceptor:
    """Adds ``authorization: Bearer <token>`` to the metadata of the calls it intercepts."""

    def __init__(self, token: str) -> None:
        self.value = f"Bearer {token}"


class _UnaryUnaryToken(_TokenInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.value), request)


class _UnaryStreamToken(_TokenInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.value), request)


class _StreamUnaryToken(_TokenInterceptor, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.value), request_iterator)


class _StreamStreamToken(_TokenInterceptor, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.value), request_iterator)


def token_client_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """The interceptors that add ``authorization: Bearer <token>`` to every call of a plaintext
    channel, one per call kind (a TLS channel carries the token as call credentials instead).

    One per kind because grpc.aio files each interceptor under the first of the four kinds it is
    an instance of (unary-unary before the others): a single class of all four kinds would reach
    unary-unary calls only, and every streaming call would go out without the token.
    """
    return [cls(token) for cls in (_UnaryUnaryToken, _UnaryStreamToken, _StreamUnaryToken, _StreamStreamToken)]
