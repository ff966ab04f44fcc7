"""Domain exceptions of pdserve and their gRPC status codes.

The error interceptor maps them (and ``ValueError``: INVALID_ARGUMENT) to statuses; an uncaught
downstream ``AioRpcError`` keeps its own. :func:`from_rpc_error` turns a status back into the
exception, so it crosses a hop unchanged.
"""
from __future__ import annotations

import grpc
import grpc.aio


class PdserveError(Exception):
    """Base of pdserve's domain exceptions; the message is sent as the status details."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Trailing metadata sent with the status (the error interceptor's), none by default."""
        return ()


class InvalidArgument(PdserveError):
    """A request field is wrong; the message names the field (``"<field>: <message>"``)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class NotFound(PdserveError):
    """An entity (request id, reservation, worker) does not exist or has expired."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(PdserveError):
    """An entity with that id already exists (e.g. a request id that is still live)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(PdserveError):
    """The system is not in a state where the call can succeed (e.g. wrong worker role)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(PdserveError):
    """Out of a resource (KV blocks, queue slots); retrying later may succeed. With
    ``retry_after_s`` set, the status carries when (:data:`RETRY_AFTER_KEY`, seconds, as HTTP's
    header; and gRPC's own server pushback, which a client retry policy honours)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_s: int = 0

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        if not self.retry_after_s:
            return ()
        return (RETRY_AFTER_KEY, str(self.retry_after_s)), (PUSHBACK_KEY, str(self.retry_after_s * 1000))


RETRY_AFTER_KEY = "retry-after"
PUSHBACK_KEY = "grpc-retry-pushback-ms"   # gRFC A6: a retry policy waits this long before its next try


class Unavailable(PdserveError):
    """The service or a dependency is not reachable or is draining; retrying may succeed."""

    code = grpc.StatusCode.UNAVAILABLE


class PeerUnavailable(Unavailable):
    """Another worker this call needed (``peer``: its address) failed or refused; the called
    worker itself is up. Sent as UNAVAILABLE with ``peer`` in the trailing metadata
    (:data:`PEER_METADATA_KEY`), so that a caller blames the peer, not the worker it called."""

    def __init__(self, message: str, peer: str) -> None:
        super().__init__(message)
        self.peer = peer

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((PEER_METADATA_KEY, self.peer),)


PEER_METADATA_KEY = "pdserve-unavailable-peer"


def unavailable_peer(err: grpc.aio.AioRpcError) -> str:
    """The peer a failed call's :class:`PeerUnavailable` named, or "" (the called worker failed)."""
    for key, value in err.trailing_metadata() or ():
        if key == PEER_METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


class DeadlineExceeded(PdserveError):
    """The request's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(PdserveError):
    """The request was cancelled."""

    code = grpc.StatusCode.CANCELLED


class Internal(PdserveError):
    """A bug or an unexpected failure inside pdserve."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[PdserveError]] = {
    cls.code: cls
    for cls in (NotFound, AlreadyExists, FailedPrecondition, ResourceExhausted, Unavailable,
                DeadlineExceeded, Cancelled, Internal)
}


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The (code, details) that ``exc`` maps to, or None when it is not a domain error."""
    if isinstance(exc, PdserveError):
        return exc.code, exc.message or type(exc).__name__
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc) or "invalid argument"
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code(), exc.details() or exc.code().name
    return None


def from_rpc_error(err: grpc.RpcError) -> PdserveError:
    """The domain exception matching a failed call's status (INTERNAL for unmapped codes;
    INVALID_ARGUMENT keeps the details, which name the field, with an empty ``field``)."""
    code = err.code() if hasattr(err, "code") else None
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgument("", details)
    cls = _BY_CODE.get(code)
    if cls is None:
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        return Internal(f"{name}: {details}")
    return cls(details)
