"""The router's side of one Prefill rpc: the request message (built before its KV target is
known) and the response stream (its first token, then the KV transfer's end). With
pdserve.router.worker_client, the router's protobuf edge for the worker rpcs."""
from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable

import grpc
import grpc.aio

from pdserve.common.grpc_utils.convert import (
    first_token_from_proto,
    reservation_from_proto,
    sampling_params_to_proto,
)
from pdserve.common.outputs import SequenceOutput
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.worker_types import Reservation
from pdserve.v1 import worker_pb2

log = logging.getLogger(__name__)

# A Prefill request, built (the prompt's ids copied) before the reservation it targets is known.
PrefillRequest = worker_pb2.PrefillRequest
# The wire form of the few sampling parameter sets clients send, converted once each (the
# messages are shared: only ever copied into a request).
wire_params = functools.lru_cache(maxsize=1024)(sampling_params_to_proto)


def prefill_request(request_id: str, token_ids, params: SamplingParams, deadline_unix_ms: int) -> PrefillRequest:
    """A Prefill request without its KV target (:meth:`WorkerClient.prefill` sets it)."""
    return worker_pb2.PrefillRequest(request_id=request_id, token_ids=token_ids, params=wire_params(params),
                                     deadline_unix_ms=deadline_unix_ms)


async def reservation(call: Awaitable[worker_pb2.ReserveResponse]) -> Reservation:
    return reservation_from_proto(await call)


class PrefillStream:
    """A Prefill call: its first token (:meth:`first_token`), then KV transfer events
    (:meth:`finish`). ``read()`` only: an rpc's read API and its iterator may not be mixed."""

    __slots__ = ("call", "request_id", "logprobs")

    def __init__(self, call: grpc.aio.UnaryStreamCall, request_id: str, logprobs: bool) -> None:
        self.call = call
        self.request_id = request_id
        self.logprobs = logprobs

    async def first_token(self) -> SequenceOutput | None:
        """The request's first output; None when the stream did not start with a FirstToken."""
        msg = await self.call.read()
        if msg is grpc.aio.EOF or msg.WhichOneof("event") != "first_token":
            return None
        return first_token_from_proto(msg.first_token, self.request_id, self.logprobs)

    async def finish(self) -> None:
        """Read the rest of the stream (the KV transfer's end)."""
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:
                return
            if msg.WhichOneof("event") == "transfer_done":
                log.debug("%s: KV transfer done: %d blocks, %.2f ms", self.request_id,
                          msg.transfer_done.num_blocks, msg.transfer_done.transfer_ms)

    def cancel(self) -> bool:
        return self.call.cancel()

    def done(self) -> bool:
        return self.call.done()
