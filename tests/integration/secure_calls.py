"""What the security integration tests send to a running deployment: the public token and its
metadata, the internal certificates' name, Generate requests (streamed with their TTFT), and
the worker's internal calls a stranger may try; each call's outcome as a status code."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc

from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

TOKEN = "s3cret-public-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
INTERNAL_NAME = "pdserve-internal"
PROMPT = [1, 504, 3458, 282, 4649, 314, 7042, 30, 2]


def gen_request(text: str | None = None, max_tokens: int = 8) -> router_pb2.GenerateRequest:
    """A greedy request of ``max_tokens`` for ``text``, or for :data:`PROMPT` without one."""
    params = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    if text is not None:
        return router_pb2.GenerateRequest(text=text, params=params)
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=PROMPT), params=params)


def code(fn: Callable[[], Any]) -> grpc.StatusCode:
    """OK when ``fn()`` returns, else the code of the RPC error it raised."""
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def stream(stub, request, metadata=AUTH) -> tuple[list[int], float]:
    """(token ids, TTFT in seconds) of one streamed request."""
    t0, ttft, ids = time.monotonic(), None, []
    for msg in stub.Generate(request, timeout=120, metadata=metadata):
        if ttft is None and msg.token_ids:
            ttft = time.monotonic() - t0
        ids.extend(msg.token_ids)
    return ids, ttft if ttft is not None else float("inf")


def internal_calls(ch: grpc.Channel) -> dict[str, grpc.StatusCode]:
    """The codes of a stranger's Reserve, PushKV, Submit and Subscribe on a worker's channel."""
    stub = worker_pb2_grpc.WorkerStub(ch)
    return {
        "Reserve": code(lambda: stub.Reserve(worker_pb2.ReserveRequest(request_id="x", router_id="stranger",
                                                                       token_ids=PROMPT), timeout=5)),
        "PushKV": code(lambda: stub.PushKV(worker_pb2.PushKVRequest(request_id="x", prefill_worker_id="p"),
                                           timeout=5)),
        "Submit": code(lambda: stub.Submit(worker_pb2.SubmitRequest(request_id="x", router_id="stranger"),
                                           timeout=5)),
        "Subscribe": code(lambda: next(iter(stub.Subscribe(worker_pb2.SubscribeRequest(router_id="stranger"),
                                                            timeout=2)))),
    }
