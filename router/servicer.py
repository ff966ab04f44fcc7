"""The router's gRPC servicers: thin layers of validate -> convert -> flow -> convert.

Errors are raised as common.grpc_utils domain exceptions; the server's error interceptor maps
them to statuses (INVALID_ARGUMENT naming the field, UNAVAILABLE, ...).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import pdserve
from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2, router_pb2_grpc
from router.flow import Flow, Job
from router.tokenization import ModelSpec, RouterTokenizer, build_prompt, check_context
from router.validation import from_proto, to_proto
from router.workers import DECODE_ROLES, PROTOCOL_VERSION, WorkerRegistry

PREFILL_CAPABLE = {common_pb2.ROLE_PREFILL, common_pb2.ROLE_BOTH}

try:
    from importlib.metadata import version as _pkg_version
    VERSION = _pkg_version("pdserve")
except Exception:  # noqa: BLE001 - not installed (running from a checkout)
    VERSION = getattr(pdserve, "__version__", "0.1.0")


class GenerationServicer(router_pb2_grpc.GenerationServicer):
    def __init__(self, flow: Flow, registry: WorkerRegistry, spec: ModelSpec,
                 tokenizer: RouterTokenizer | None) -> None:
        self.flow = flow
        self.registry = registry
        self.spec = spec
        self.tokenizer = tokenizer

    def _job(self, request: router_pb2.GenerateRequest, context: Any) -> Job:
        params = from_proto(request.params, self.spec.vocab_size, self.tokenizer is not None)
        prompt = build_prompt(request, self.tokenizer, self.spec, self.spec.vocab_size)
        max_tokens = check_context(prompt, params.max_tokens, self.registry.max_model_len())
        sampling = dataclasses.replace(params.sampling, max_tokens=max_tokens)
        return self.flow.make_job(
            request.request_id or self.flow.new_request_id(), prompt, sampling, to_proto(sampling, max_tokens),
            params.stop, request.include_stop_str_in_output, not request.keep_special_tokens,
            context.time_remaining())

    async def Generate(self, request: router_pb2.GenerateRequest, context: Any):
        job = self._job(request, context)
        async for response in self.flow.generate(job, "Generate"):
            yield response

    async def GenerateUnary(self, request: router_pb2.GenerateRequest, context: Any) -> router_pb2.GenerateResult:
        job = self._job(request, context)
        result = router_pb2.GenerateResult(request_id=job.request_id)
        texts: list[str] = []
        async for r in self.flow.generate(job, "GenerateUnary"):
            texts.append(r.text)
            result.token_ids.extend(r.token_ids)
            result.logprobs.extend(r.logprobs)
            if r.finish_reason:
                result.finish_reason = r.finish_reason
                result.usage.CopyFrom(r.usage)
                result.matched_stop = r.matched_stop
        result.text = "".join(texts)
        return result

    async def Tokenize(self, request: router_pb2.TokenizeRequest, context: Any) -> router_pb2.TokenizeResponse:
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
        return common_pb2.ServerInfo(
            protocol_version=PROTOCOL_VERSION, role=common_pb2.ROLE_ROUTER, model=self.spec.name,
            dtype=self.registry.dtype(), block_size=self.registry.block_size,
            max_model_len=self.registry.max_model_len(), num_kv_blocks=0, worker_id=self.router_id,
            version=VERSION, vocab_size=self.spec.vocab_size)
