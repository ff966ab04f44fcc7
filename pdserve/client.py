"""A small synchronous client of the router's public API (used by ``pdserve generate``):
``generate`` / ``stream_generate(address, prompt, SamplingParams(...))``.

``prompt``: a string (a user message with ``chat=True``, plain text otherwise), a list of
``{"role", "content"}`` messages, or token ids. Failures raise the matching
:class:`pdserve.common.grpc_utils.PdserveError`. Importing it does not import torch.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.common.grpc_utils.convert import sampling_params_to_proto
from pdserve.common.grpc_utils.errors import from_rpc_error
from pdserve.common.sampling_params import SamplingParams
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.max_send_message_length", 64 * 1024 * 1024)]


@dataclass
class GenerateOutput:
    request_id: str
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = ""            # "stop", "length" or "stop_string"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    matched_stop: str = ""


def build_request(prompt: Prompt, params: SamplingParams | None = None, chat: bool = True,
                  stop: Sequence[str] = (), request_id: str = "") -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(request_id=request_id,
                                     params=sampling_params_to_proto(params or SamplingParams(), stop=list(stop)))
    if isinstance(prompt, str):
        if chat:
            req.chat.messages.add(role="user", content=prompt)
        else:
            req.text = prompt
    else:
        messages = [m for m in prompt if isinstance(m, Mapping)]
        ids = [int(t) for t in prompt if not isinstance(t, Mapping)]
        if messages and ids:
            raise TypeError("prompt: a list of chat messages or a list of token ids, not both")
        if messages:
            for m in messages:
                req.chat.messages.add(role=m["role"], content=m["content"])
        else:
            req.token_ids.ids.extend(ids)
    return req


def finish_reason_name(value: int) -> str:
    """``FINISH_REASON_LENGTH`` -> ``"length"``; 0 (unset) -> ``""``."""
    return common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower() if value else ""


def stream_responses(address: str, request: router_pb2.GenerateRequest,
                     timeout: float | None = 120.0) -> Iterator[router_pb2.GenerateResponse]:
    """The raw GenerateResponse stream; closing the iterator early cancels the request."""
    with grpc.insecure_channel(address, options=_OPTIONS) as channel:
        stub = router_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(request, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()


def stream_generate(address: str, prompt: Prompt, params: SamplingParams | None = None, chat: bool = True,
                    timeout: float | None = 120.0, stop: Sequence[str] = ()) -> Iterator[str]:
    """The generated text, piece by piece as the router streams it."""
    for resp in stream_responses(address, build_request(prompt, params, chat, stop), timeout):
        if resp.text:
            yield resp.text


def generate(address: str, prompt: Prompt, params: SamplingParams | None = None, chat: bool = True,
             timeout: float | None = 120.0, stop: Sequence[str] = ()) -> GenerateOutput:
    """The whole result of one request (streamed underneath)."""
    out = GenerateOutput(request_id="", text="")
    texts: list[str] = []
    for resp in stream_responses(address, build_request(prompt, params, chat, stop), timeout):
        out.request_id = resp.request_id
        texts.append(resp.text)
        out.token_ids.extend(resp.token_ids)
        out.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            out.finish_reason = finish_reason_name(resp.finish_reason)
            out.prompt_tokens = resp.usage.prompt_tokens
            out.completion_tokens = resp.usage.completion_tokens
            out.cached_tokens = resp.usage.cached_tokens
            out.matched_stop = resp.matched_stop
    out.text = "".join(texts)
    return out
