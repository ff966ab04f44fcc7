"""The one server interceptor of pdserve: domain exceptions -> gRPC statuses.

:class:`ErrorInterceptor` wraps every handler: PdserveError / ValueError -> the mapped status
(DEBUG log; with the error's trailing metadata: a PeerUnavailable's peer, a ResourceExhausted's
retry-after); a downstream AioRpcError keeps its status (WARNING); NotImplementedError ->
UNIMPLEMENTED; anything else -> INTERNAL (ERROR, traceback); ``context.abort`` and cancellation
pass through; undecodable request bytes -> INVALID_ARGUMENT before the handler runs.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from pdserve.common.grpc_utils.errors import PdserveError, status_for

log = logging.getLogger(__name__)


class Undecodable:
    """What the wrapped deserializer returns for bytes it cannot parse (grpc would otherwise
    fail the call with a status that blames the server)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error

    def details(self) -> str:
        return f"request is not a valid message of this method: {type(self.error).__name__}: {self.error}"


def _safe_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and friends: the caller's bytes
            return Undecodable(exc)

    return deserialize


async def _checked_request(request: Any, context: grpc.aio.ServicerContext, method: str) -> Any:
    """``request``, or abort INVALID_ARGUMENT when it did not decode; a request stream is
    wrapped so that each of its messages is checked."""
    if isinstance(request, Undecodable):
        log.debug("%s -> INVALID_ARGUMENT: %s", method, request.details())
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.details())
    if hasattr(request, "__aiter__"):
        return _checked_stream(request, context)
    return request


async def _checked_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    async for item in requests:
        if isinstance(item, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, item.details())
        yield item


async def _abort(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    """Abort ``context`` with the status ``exc`` maps to; always raises."""
    mapped = status_for(exc)
    if isinstance(exc, NotImplementedError):
        code, details = grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented by this server"
        log.debug("%s -> UNIMPLEMENTED", method)
    elif mapped is None:
        log.error("unexpected error in %s", method, exc_info=exc)
        code, details = grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"
    else:
        code, details = mapped
        level = logging.WARNING if isinstance(exc, grpc.aio.AioRpcError) else logging.DEBUG
        log.log(level, "%s -> %s: %s", method, code.name, details)
    trailing = exc.trailing_metadata() if isinstance(exc, PdserveError) else ()
    try:
        await context.abort(code, details, trailing_metadata=trailing)
    except (grpc.aio.AbortError, grpc.aio.UsageError):   # aborted; or aborted twice: a bug, surfaced
        raise
    except Exception as unsent:  # noqa: BLE001 - the status could not go out
        # The call ended before its status was sent (the client's deadline or cancel won the race
        # with this error; gRPC's "execute_batch" fails): nobody is left to tell. End the handler
        # as a cancelled one ends, instead of gRPC logging the failed send as an error.
        log.debug("%s: %s not sent, the call had ended (%r)", method, code.name, unsent)
        raise asyncio.CancelledError from None


def _wrap_unary_response(behavior: Callable[..., Any], method: str) -> Callable[..., Awaitable[Any]]:
    """Wrap a unary_unary / stream_unary behavior (returns one response), or a streaming one
    that writes with ``context.write`` (its coroutine is awaited the same way)."""

    async def wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        request_or_iterator = await _checked_request(request_or_iterator, context, method)
        try:
            result = behavior(request_or_iterator, context)
            if inspect.isawaitable(result):
                result = await result
            return result
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped or reported as INTERNAL
            await _abort(exc, context, method)

    return wrapper


def _wrap_stream_response(behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """Wrap a unary_stream / stream_stream behavior.

    An async generator stays an async generator (grpc.aio iterates it); a coroutine that
    writes with ``context.write`` stays a coroutine; a plain generator is iterated.
    """
    if inspect.isasyncgenfunction(behavior) or inspect.isgeneratorfunction(behavior):

        async def gen_wrapper(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            request_or_iterator = await _checked_request(request_or_iterator, context, method)
            try:
                stream = behavior(request_or_iterator, context)
                if inspect.isasyncgen(stream):
                    async for response in stream:
                        yield response
                else:
                    for response in stream:
                        yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # noqa: BLE001
                await _abort(exc, context, method)

        return gen_wrapper

    return _wrap_unary_response(behavior, method)   # a coroutine: awaited as a unary one is


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions raised by servicers to gRPC statuses (see the module docstring)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        kwargs = dict(request_deserializer=_safe_deserializer(handler.request_deserializer),
                      response_serializer=handler.response_serializer)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary_response(handler.unary_unary, method), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary_response(handler.stream_unary, method), **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream_response(handler.unary_stream, method), **kwargs)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _wrap_stream_response(handler.stream_stream, method), **kwargs)
        return handler
