"""How a try of a request fails (pdserve.router.attempt): before the first token every failure is
a :class:`Retry`; after it, one another worker could continue from (the worker or its stream
failed) a :class:`Cut`; any other is the mapped domain error. A deadline that passed wins over
all of them. A worker's own ending of a request (a finish reason other than STOP or LENGTH)
becomes a domain error too (:func:`finish_error`)."""
from __future__ import annotations

from collections.abc import Callable

import grpc
import grpc.aio

from pdserve.common.grpc_utils import (
    DeadlineExceeded,
    Internal,
    PdserveError,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from pdserve.common.outputs import FinishReason, SequenceOutput

FINAL_OK = (FinishReason.STOP, FinishReason.LENGTH)
_NORMAL = (None, *FINAL_OK)
_NOT_RETRYABLE = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)
# The error of a reservation whose lease ran out on the decode worker (its SequenceOutput.error;
# pdserve.decode_worker.state.LEASE_EXPIRED): the blocks could not be held, RESOURCE_EXHAUSTED.
LEASE_EXPIRED = "reservation lease expired"


class Retry(Exception):
    """A failure before the first token: ``cause`` is what the client gets if no retry is left."""

    def __init__(self, cause: PdserveError, worker_key: str) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.worker_key = worker_key


class Cut(Exception):
    """A stream that failed after its first token on ``worker_key`` (``cause``: what the client
    gets unless the flow continues the request elsewhere)."""

    def __init__(self, cause: PdserveError, worker_key: str) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.worker_key = worker_key


def classify(err: BaseException, worker_key: str, where: str, first_seen: bool, expired: bool,
             job_expired: Callable[[], bool]) -> BaseException:
    """``err`` (an rpc error or a domain error) of ``where`` on ``worker_key`` as the try raises
    it (module docstring); ``expired``: the try's deadline timer fired, ``job_expired()``: the
    request's deadline has passed. A Retry or a Cut is returned as it is (already decided)."""
    if isinstance(err, (Cut, Retry)):
        return err
    if isinstance(err, grpc.aio.AioRpcError):
        code = err.code()
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and job_expired():
            return DeadlineExceeded(f"deadline passed during {where}")
        mapped: PdserveError = from_rpc_error(err)
        mapped.message = f"{where} on {worker_key}: {mapped.message}"
        retryable = code not in _NOT_RETRYABLE
    else:
        mapped = err if isinstance(err, PdserveError) else Internal(f"{where}: {err}")
        retryable = not isinstance(err, DeadlineExceeded)
    if expired or job_expired():
        return DeadlineExceeded("deadline passed")
    if retryable:
        return Cut(mapped, worker_key) if first_seen else Retry(mapped, worker_key)
    return mapped


def finish_error(out: SequenceOutput, rid: str, worker_key: str) -> PdserveError | None:
    """The domain error of a worker's output that ends request ``rid`` abnormally; None for a
    step that goes on or ends with STOP or LENGTH."""
    reason = out.finish_reason
    if reason in _NORMAL:
        return None
    if reason is FinishReason.DEADLINE:
        return DeadlineExceeded(f"request {rid}: deadline passed on {worker_key}")
    if reason is FinishReason.ERROR and LEASE_EXPIRED in out.error:
        return ResourceExhausted(f"request {rid}: {worker_key} could not hold its KV reservation ({out.error})")
    if reason is FinishReason.CANCELLED:
        return Unavailable(f"request {rid} was cancelled by worker {worker_key}")
    name = reason.name if reason is not None else "?"
    return Internal(f"request {rid} failed on worker {worker_key} ({name}): {out.error}")
