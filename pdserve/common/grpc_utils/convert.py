"""The one converter between the wire types (pdserve.v1) and the domain types (SamplingParams,
pdserve.common.outputs, pdserve.common.worker_types), used by the router and both workers.

Zero values follow common.proto: top_p 0 -> 1.0, top_k 0 -> -1, repetition_penalty 0 -> 1.0,
max_tokens 0 -> ``rest_of_context``; every other zero is the field's "off". A bad field raises
InvalidArgument naming ``params.<field>`` (``params.guide.<kind>`` for a guide that does not
compile: checked here, once per distinct message at the router, so no worker sees a bad one).
"""
from __future__ import annotations

import dataclasses
import math

from pdserve.common.grpc_utils.errors import InvalidArgument
from pdserve.common.guided.grammar import check_guide
from pdserve.common.outputs import FinishReason, SequenceOutput, TopLogprobs
from pdserve.common.sampling_params import Guide, InvalidParameter, SamplingParams
from pdserve.common.worker_types import Reservation, Role, WorkerInfo, WorkerStats
from pdserve.v1 import common_pb2, worker_pb2

_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")

_FINISH_TO_PROTO: dict[FinishReason, common_pb2.FinishReason] = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: common_pb2.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in _FINISH_TO_PROTO.items()}
_FINISH_FROM_PROTO[common_pb2.FINISH_REASON_STOP_STRING] = FinishReason.STOP   # the router's, on the wire

_ROLE_TO_PROTO: dict[Role, common_pb2.Role] = {
    Role.ROUTER: common_pb2.ROLE_ROUTER,
    Role.PREFILL: common_pb2.ROLE_PREFILL,
    Role.DECODE: common_pb2.ROLE_DECODE,
    Role.BOTH: common_pb2.ROLE_BOTH,
}
_ROLE_FROM_PROTO: dict[int, Role] = {v: k for k, v in _ROLE_TO_PROTO.items()}
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerStats) if f.name != "role")


def sampling_params_from_proto(p: common_pb2.SamplingParams, rest_of_context: int,
                               vocab_size: int | None = None) -> SamplingParams:
    """The engine's SamplingParams for ``p`` (stop strings are not the engine's: see the
    router); ``max_tokens`` 0 becomes ``rest_of_context``. Raises InvalidArgument."""
    for name in _FLOAT_FIELDS:
        value = getattr(p, name)
        if not math.isfinite(value):
            raise InvalidArgument(f"params.{name}", f"must be a finite number, got {value}")
    if p.top_p < 0:
        raise InvalidArgument("params.top_p", f"must be in (0, 1], got {p.top_p}")
    if p.repetition_penalty < 0:
        raise InvalidArgument("params.repetition_penalty", f"must be > 0, got {p.repetition_penalty}")
    if vocab_size is not None:
        for i, tid in enumerate(p.stop_token_ids):
            if tid >= vocab_size:
                raise InvalidArgument(f"params.stop_token_ids[{i}]",
                                      f"{tid} is out of the vocabulary (size {vocab_size})")
        for tid in p.logit_bias:
            if tid >= vocab_size:
                raise InvalidArgument("params.logit_bias",
                                      f"token id {tid} is out of the vocabulary (size {vocab_size})")
    try:
        guide = guide_from_proto(p.guide) if p.HasField("guide") else None
        check_guide(guide)
        return SamplingParams(
            temperature=p.temperature,
            top_p=p.top_p or 1.0,
            top_k=p.top_k or -1,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty or 1.0,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            seed=p.seed if p.HasField("seed") else None,
            max_tokens=p.max_tokens or rest_of_context,
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.logprobs,
            top_logprobs=p.top_logprobs,
            prompt_logprobs=p.prompt_logprobs,
            logit_bias=tuple(sorted(p.logit_bias.items())),
            min_tokens=p.min_tokens,
            guide=guide,
            n=p.n or 1,
        )
    except InvalidParameter as e:
        message, prefix = str(e), f"{e.field}: "
        raise InvalidArgument(f"params.{e.field}",
                              message[len(prefix):] if message.startswith(prefix) else message) from e


def sampling_params_for_prompt(p: common_pb2.SamplingParams, max_model_len: int, num_prompt_tokens: int
                               ) -> SamplingParams:
    """A worker's form of :func:`sampling_params_from_proto`: max_tokens 0 fills the worker's
    context after the prompt (at least 1: a prompt that fills it is the engine's error)."""
    return sampling_params_from_proto(p, max(1, max_model_len - num_prompt_tokens))


def sampling_params_to_proto(s: SamplingParams, *, max_tokens: int | None = None,
                             stop: list[str] | tuple[str, ...] = ()) -> common_pb2.SamplingParams:
    """The explicit wire form of ``s`` (no zero-means-default left); ``max_tokens`` overrides
    ``s.max_tokens``; ``stop``: the router's stop strings (empty toward workers)."""
    p = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs, stop=list(stop),
        top_logprobs=s.top_logprobs, prompt_logprobs=s.prompt_logprobs, logit_bias=dict(s.logit_bias),
        min_tokens=s.min_tokens, n=s.n)
    if s.seed is not None:
        p.seed = s.seed
    if s.guide is not None:
        p.guide.CopyFrom(guide_to_proto(s.guide))
    return p


def guide_from_proto(g: common_pb2.Guide) -> Guide:
    """The domain Guide of a wire Guide (shape checked; compiled by the caller). Raises
    InvalidParameter naming ``guide`` / ``guide.<kind>``."""
    kind = g.WhichOneof("kind")
    if kind is None:
        raise InvalidParameter("guide", "set one of json_schema, json_object, regex, choice, grammar")
    if kind == "json_object":
        if not g.json_object:
            raise InvalidParameter("guide.json_object", "must be true when set")
        return Guide("json_object")
    if kind == "choice":
        return Guide("choice", choices=tuple(g.choice.choices))
    return Guide(kind, getattr(g, kind))


def guide_to_proto(guide: Guide) -> common_pb2.Guide:
    if guide.kind == "json_object":
        return common_pb2.Guide(json_object=True)
    if guide.kind == "choice":
        return common_pb2.Guide(choice=common_pb2.GuideChoices(choices=list(guide.choices)))
    out = common_pb2.Guide()
    setattr(out, guide.kind, guide.value)       # json_schema, regex or grammar: a string field
    return out


def finish_reason_to_proto(reason: FinishReason | None, stop_string: bool = False) -> common_pb2.FinishReason:
    """None -> UNSPECIFIED (not finished); ``stop_string``: a STOP by one of the router's stop
    strings (FINISH_REASON_STOP_STRING, the router's answers only)."""
    if reason is None:
        return common_pb2.FINISH_REASON_UNSPECIFIED
    if stop_string and reason is FinishReason.STOP:
        return common_pb2.FINISH_REASON_STOP_STRING
    return _FINISH_TO_PROTO[reason]


def finish_reason_from_proto(value: int) -> FinishReason | None:
    """UNSPECIFIED (and unknown values) -> None; STOP_STRING -> STOP."""
    return _FINISH_FROM_PROTO.get(value)


def finish_reason_name(reason: FinishReason | None, stop_string: bool = False) -> str:
    """The wire enum's name (``FINISH_REASON_STOP``, ..._STOP_STRING, ..._UNSPECIFIED)."""
    return common_pb2.FinishReason.Name(finish_reason_to_proto(reason, stop_string))


def top_logprobs_to_proto(tops: list[TopLogprobs]) -> list[common_pb2.TopLogprobs]:
    return [common_pb2.TopLogprobs(token_ids=ids, logprobs=lps) for ids, lps in tops]


def top_logprobs_from_proto(tops) -> list[TopLogprobs]:
    return [(list(t.token_ids), list(t.logprobs)) for t in tops]


def sequence_output_from_proto(p: worker_pb2.SequenceOutput) -> SequenceOutput:
    return SequenceOutput(p.request_id, list(p.token_ids), list(p.logprobs), _FINISH_FROM_PROTO.get(p.finish_reason),
                          p.num_prompt_tokens, p.num_cached_tokens, p.error, top_logprobs_from_proto(p.top_logprobs),
                          list(p.prompt_logprobs), top_logprobs_from_proto(p.prompt_top_logprobs), p.index)


def sequence_output_to_proto(out: SequenceOutput) -> worker_pb2.SequenceOutput:
    return worker_pb2.SequenceOutput(
        request_id=out.request_id, token_ids=out.token_ids, logprobs=out.logprobs,
        finish_reason=finish_reason_to_proto(out.finish_reason), num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens, error=out.error, top_logprobs=top_logprobs_to_proto(out.top_logprobs),
        prompt_logprobs=out.prompt_logprobs, prompt_top_logprobs=top_logprobs_to_proto(out.prompt_top_logprobs),
        index=out.index)


def first_token_from_proto(p: worker_pb2.FirstToken, request_id: str, logprobs: bool) -> SequenceOutput:
    """A Prefill stream's FirstToken as the request's first output (its logprob, top logprobs
    and prompt logprobs only when the request asked for logprobs)."""
    out = SequenceOutput(request_id, [p.token_id], [p.logprob] if logprobs else [],
                         _FINISH_FROM_PROTO.get(p.finish_reason), num_cached_tokens=p.num_cached_tokens)
    if logprobs:
        if p.HasField("top_logprobs"):
            out.top_logprobs = top_logprobs_from_proto([p.top_logprobs])
        out.prompt_logprobs = list(p.prompt_logprobs)
        out.prompt_top_logprobs = top_logprobs_from_proto(p.prompt_top_logprobs)
    return out


def role_to_proto(role: Role | None) -> common_pb2.Role:
    return _ROLE_TO_PROTO[role] if role is not None else common_pb2.ROLE_UNSPECIFIED


def role_from_proto(value: int) -> Role | None:
    """ROLE_UNSPECIFIED (and unknown values) -> None."""
    return _ROLE_FROM_PROTO.get(value)


def worker_info_from_proto(p: common_pb2.ServerInfo) -> WorkerInfo:
    return WorkerInfo(p.protocol_version, role_from_proto(p.role), p.model, p.dtype, p.block_size, p.max_model_len,
                      p.num_kv_blocks, p.worker_id, p.version, p.vocab_size, p.kv_cache_dtype,
                      p.tensor_parallel_size, p.num_kv_heads, p.head_dim)


def worker_info_to_proto(info: WorkerInfo) -> common_pb2.ServerInfo:
    return common_pb2.ServerInfo(
        protocol_version=info.protocol_version, role=role_to_proto(info.role), model=info.model, dtype=info.dtype,
        block_size=info.block_size, max_model_len=info.max_model_len, num_kv_blocks=info.num_kv_blocks,
        worker_id=info.worker_id, version=info.version, vocab_size=info.vocab_size,
        kv_cache_dtype=info.kv_cache_dtype, tensor_parallel_size=info.tensor_parallel_size,
        num_kv_heads=info.num_kv_heads, head_dim=info.head_dim)


def worker_stats_from_proto(p: worker_pb2.WorkerStats) -> WorkerStats:
    return WorkerStats(role=role_from_proto(p.role), **{name: getattr(p, name) for name in _STATS_FIELDS})


def reservation_from_proto(p: worker_pb2.ReserveResponse) -> Reservation:
    return Reservation(list(p.block_ids), p.num_cached_tokens, p.kv_store_address, p.worker_id,
                       p.lease_expires_unix_ms, p.tensor_parallel_size)


def deadline_from_proto(deadline_unix_ms: int) -> float | None:
    """Unix seconds, or None for "no deadline" (0)."""
    return deadline_unix_ms / 1000.0 if deadline_unix_ms else None
