"""Conversions between the wire types (pdserve.v1) and the engine's types, shared by servicers."""
from __future__ import annotations

from common.engine.sampling_params import SamplingParams
from common.engine.sequence import FinishReason
from pdserve.v1 import common_pb2

DEFAULT_MAX_TOKENS = 256

_FINISH_TO_PROTO = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.DEADLINE: common_pb2.FINISH_REASON_DEADLINE,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PROTO = {v: k for k, v in _FINISH_TO_PROTO.items()}


def sampling_params_from_proto(p: common_pb2.SamplingParams, default_max_tokens: int = DEFAULT_MAX_TOKENS
                               ) -> SamplingParams:
    """Zero means "off" / "server default" as common.proto documents; raises InvalidParameter."""
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p != 0 else 1.0,
        top_k=p.top_k if p.top_k not in (0, -1) else -1,
        min_p=p.min_p,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 0 else 1.0,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seed=p.seed if p.HasField("seed") else None,
        max_tokens=p.max_tokens or default_max_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
    )


def sampling_params_to_proto(s: SamplingParams, stop: list[str] | None = None) -> common_pb2.SamplingParams:
    p = common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs,
        stop=list(stop or []))
    if s.seed is not None:
        p.seed = s.seed
    return p


def finish_reason_to_proto(reason: FinishReason | None) -> int:
    return _FINISH_TO_PROTO[reason] if reason is not None else common_pb2.FINISH_REASON_UNSPECIFIED


def finish_reason_from_proto(value: int) -> FinishReason | None:
    return _FINISH_FROM_PROTO.get(value)


def deadline_from_proto(deadline_unix_ms: int) -> float | None:
    """Unix seconds, or None for "no deadline" (0)."""
    return deadline_unix_ms / 1000.0 if deadline_unix_ms else None
