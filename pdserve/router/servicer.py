"""The router's gRPC servicers: thin layers of validate -> convert -> flow -> convert.

The flow yields :class:`~pdserve.router.output.TextOutput` (domain); :func:`generate_response`
is its wire form (a STOP with ``matched_stop`` is FINISH_REASON_STOP_STRING).

Errors are raised as pdserve.common.grpc_utils domain exceptions; the server's error interceptor maps
them to statuses (INVALID_ARGUMENT naming the field, UNAVAILABLE, ...).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import pdserve
from pdserve.common import telemetry
from pdserve.common.grpc_utils import InvalidArgument, Service
from pdserve.common.grpc_utils.convert import finish_reason_to_proto, top_logprobs_to_proto, worker_info_to_proto
from pdserve.common.grpc_utils.protocol import PROTOCOL_VERSION
from pdserve.common.worker_types import DECODE_ROLES, PREFILL_CAPABLE, Role, WorkerInfo
from pdserve.router import slo
from pdserve.router.flow import Flow, Job
from pdserve.router.output import TextOutput
from pdserve.router.tokenization import ModelSpec, RouterTokenizer, build_prompt, check_context
from pdserve.router.validation import DEFAULT_MAX_TOKEN_CHARS, ParamsCache, PromptBounds, max_token_chars
from pdserve.router.workers import WorkerRegistry
from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)

try:
    from importlib.metadata import version as _pkg_version
    VERSION = _pkg_version("pdserve")
except Exception:  # noqa: BLE001 - not installed (running from a checkout)
    VERSION = getattr(pdserve, "__version__", "0.1.0")


class EarlyHeaders:
    """A Generate stream's response headers, sent as soon as its first worker rpc is on the way
    (so the client reads them while the workers prefill). They go out as a task that must be
    finished before the first write (or an abort) on the call: see :meth:`settle`."""

    __slots__ = ("context", "task")

    def __init__(self, context: Any) -> None:
        self.context = context
        self.task: asyncio.Task | None = None

    def send(self) -> None:
        """Start sending them (once; a retry calls again)."""
        if self.task is None:
            self.task = asyncio.ensure_future(self.context.send_initial_metadata(()))
            self.task.add_done_callback(_headers_sent)

    async def settle(self) -> None:
        """Wait until the headers are sent (or failed: the call is gone then)."""
        task = self.task
        if task is not None and not task.done():
            try:
                await task
            except Exception:  # noqa: BLE001 - reported by _headers_sent; the write or abort follows
                pass


def generate_response(out: TextOutput) -> router_pb2.GenerateResponse:
    """The wire form of one output; finish reason, usage and matched stop on the last only."""
    resp = router_pb2.GenerateResponse(
        request_id=out.request_id, token_ids=out.token_ids, text=out.text, logprobs=out.logprobs,
        top_logprobs=top_logprobs_to_proto(out.top_logprobs), prompt_logprobs=out.prompt_logprobs,
        prompt_top_logprobs=top_logprobs_to_proto(out.prompt_top_logprobs), index=out.index)
    if out.finish_reason is not None:
        resp.finish_reason = finish_reason_to_proto(out.finish_reason, out.matched_stop is not None)
        resp.usage.prompt_tokens = out.num_prompt_tokens
        resp.usage.completion_tokens = out.num_output_tokens
        resp.usage.cached_tokens = out.num_cached_tokens
        if out.matched_stop is not None:
            resp.matched_stop = out.matched_stop
    return resp


def _headers_sent(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("response headers not sent: %r", task.exception())


class GenerationServicer(router_pb2_grpc.GenerationServicer):
    def __init__(self, flow: Flow, registry: WorkerRegistry, spec: ModelSpec,
                 tokenizer: RouterTokenizer | None) -> None:
        self.flow = flow
        self.registry = registry
        self.spec = spec
        self.tokenizer = tokenizer
        self.params = ParamsCache(spec.vocab_size, tokenizer is not None)
        # Prompts that can never fit are refused before tokenization (pdserve.router.validation).
        self.bounds = PromptBounds(spec.max_model_len, max_token_chars(tokenizer.hf) if tokenizer
                                   else DEFAULT_MAX_TOKEN_CHARS)

    def _job(self, request: router_pb2.GenerateRequest, context: Any, method: str) -> Job:
        try:
            return self.job(request, context.time_remaining())
        except Exception as e:
            self.flow.metrics.rejected(method, e)      # refused before it ran: counted by status
            raise

    def job(self, request: router_pb2.GenerateRequest, time_remaining: float | None) -> Job:
        """Validate, tokenize and size ``request``: the one request path of both front doors
        (gRPC Generate and the OpenAI HTTP API, pdserve.router.openai_api)."""
        key, params = self.params.validate(request.params)
        self.bounds.check(request)
        with telemetry.span("tokenize", request.request_id):
            prompt = build_prompt(request, self.tokenizer, self.spec, self.spec.vocab_size)
        max_tokens = check_context(prompt, params.max_tokens, self.registry.max_model_len())
        sampling = self.params.resolve(key, params, max_tokens)
        return self.flow.make_job(
            request.request_id or self.flow.new_request_id(), prompt, sampling,
            params.stop, request.include_stop_str_in_output, not request.keep_special_tokens,
            time_remaining, slo.from_proto(request.slo if request.HasField("slo") else None))

    async def Generate(self, request: router_pb2.GenerateRequest, context: Any):
        job = self._job(request, context, "Generate")
        headers = EarlyHeaders(context)
        job.on_dispatch = headers.send
        pending: EarlyHeaders | None = headers
        try:
            async for out in self.flow.generate(job, "Generate"):
                if pending is not None:         # done long ago, normally: no wait
                    await pending.settle()
                    pending = None
                yield generate_response(out)
        except Exception:
            await headers.settle()      # the error interceptor's abort must not race the headers
            raise

    async def GenerateUnary(self, request: router_pb2.GenerateRequest, context: Any) -> router_pb2.GenerateResult:
        job = self._job(request, context, "GenerateUnary")
        if job.sampling.n > 1:
            raise InvalidArgument("params.n", "n > 1 needs the streaming Generate (one result per sample)")
        result = router_pb2.GenerateResult(request_id=job.request_id)
        texts: list[str] = []
        async for out in self.flow.generate(job, "GenerateUnary"):
            texts.append(out.text)
            result.token_ids.extend(out.token_ids)
            result.logprobs.extend(out.logprobs)
            result.top_logprobs.extend(top_logprobs_to_proto(out.top_logprobs))
            result.prompt_logprobs.extend(out.prompt_logprobs)
            result.prompt_top_logprobs.extend(top_logprobs_to_proto(out.prompt_top_logprobs))
            if out.finish_reason is not None:
                last = generate_response(out)
                result.finish_reason = last.finish_reason
                result.usage.CopyFrom(last.usage)
                result.matched_stop = last.matched_stop
        result.text = "".join(texts)
        return result

    async def Tokenize(self, request: router_pb2.TokenizeRequest, context: Any) -> router_pb2.TokenizeResponse:
        self.bounds.check(request)
        prompt = build_prompt(request, self.tokenizer, self.spec, self.spec.vocab_size)
        return router_pb2.TokenizeResponse(token_ids=prompt.token_ids, count=len(prompt.token_ids),
                                           rendered_prompt=prompt.rendered)

    async def GetModelInfo(self, request: router_pb2.GetModelInfoRequest, context: Any) -> router_pb2.ModelInfo:
        return router_pb2.ModelInfo(
            model=self.spec.name, max_model_len=self.registry.max_model_len(), vocab_size=self.spec.vocab_size,
            block_size=self.registry.block_size, eos_token_ids=list(self.spec.eos_token_ids),
            has_chat_template=bool(self.tokenizer is not None and self.tokenizer.has_chat_template),
            num_prefill_workers=self.registry.count_up(PREFILL_CAPABLE),
            num_decode_workers=self.registry.count_up(DECODE_ROLES))


class InfoServicer(common_pb2_grpc.InfoServiceServicer):
    def __init__(self, registry: WorkerRegistry, spec: ModelSpec, router_id: str) -> None:
        self.registry = registry
        self.spec = spec
        self.router_id = router_id

    async def Info(self, request: common_pb2.InfoRequest, context: Any) -> common_pb2.ServerInfo:
        return worker_info_to_proto(WorkerInfo(
            protocol_version=PROTOCOL_VERSION, role=Role.ROUTER, model=self.spec.name,
            dtype=self.registry.dtype(), block_size=self.registry.block_size,
            max_model_len=self.registry.max_model_len(), num_kv_blocks=0, worker_id=self.router_id,
            version=VERSION, vocab_size=self.spec.vocab_size))


def services(generation: GenerationServicer, info: InfoServicer) -> list[Service]:
    """The router's pdserve.v1 services (Generation, InfoService), for build_server."""
    return [
        Service(router_pb2.DESCRIPTOR.services_by_name["Generation"], router_pb2_grpc.add_GenerationServicer_to_server,
                generation),
        Service(common_pb2.DESCRIPTOR.services_by_name["InfoService"],
                common_pb2_grpc.add_InfoServiceServicer_to_server, info),
    ]
