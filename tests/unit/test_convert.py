"""The one converter: SamplingParams (the zero rule of common.proto, the same for the router
and the workers; bad fields are INVALID_ARGUMENT naming params.<field>), finish reasons,
outputs, roles, worker identity, stats and reservations (wire <-> domain)."""
from __future__ import annotations

import math

import pytest

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.common.grpc_utils.convert import (
    finish_reason_from_proto,
    finish_reason_name,
    finish_reason_to_proto,
    first_token_from_proto,
    reservation_from_proto,
    role_from_proto,
    role_to_proto,
    sampling_params_for_prompt,
    sampling_params_from_proto,
    sampling_params_to_proto,
    sequence_output_from_proto,
    sequence_output_to_proto,
    worker_info_from_proto,
    worker_info_to_proto,
    worker_stats_from_proto,
)
from pdserve.common.outputs import FinishReason, SequenceOutput
from pdserve.common.worker_types import Reservation, Role, WorkerInfo, WorkerStats
from pdserve.router.validation import ParamsCache
from pdserve.v1 import common_pb2, worker_pb2


def test_zero_values_follow_one_rule():
    s = sampling_params_from_proto(common_pb2.SamplingParams(), rest_of_context=1000)
    assert (s.temperature, s.top_p, s.top_k, s.repetition_penalty, s.max_tokens, s.seed) == (0.0, 1.0, -1, 1.0,
                                                                                            1000, None)
    explicit = sampling_params_from_proto(common_pb2.SamplingParams(max_tokens=7, top_k=5, top_p=0.5), 1000)
    assert (explicit.max_tokens, explicit.top_k, explicit.top_p) == (7, 5, 0.5)


def test_worker_fills_the_rest_of_its_context():
    assert sampling_params_for_prompt(common_pb2.SamplingParams(), 1024, 24).max_tokens == 1000
    assert sampling_params_for_prompt(common_pb2.SamplingParams(max_tokens=3), 1024, 24).max_tokens == 3
    # a prompt that fills the context is the engine's error, not the converter's
    assert sampling_params_for_prompt(common_pb2.SamplingParams(), 1024, 1024).max_tokens == 1


def test_router_and_worker_agree():
    wire = common_pb2.SamplingParams(temperature=0.7, top_p=0.9, seed=3)
    cache = ParamsCache(vocab_size=512, has_tokenizer=False)
    key, params = cache.validate(wire)
    assert params.max_tokens == 0                      # left to the server
    sampling = cache.resolve(key, params, 1000)
    to_worker = sampling_params_to_proto(sampling)      # what the router's worker client sends
    assert to_worker.max_tokens == 1000
    assert sampling_params_for_prompt(to_worker, 1024, 24) == sampling
    assert sampling_params_for_prompt(wire, 1024, 24) == sampling   # a worker called directly: same answer
    assert sampling_params_to_proto(sampling, stop=["x"]).stop == ["x"]


@pytest.mark.parametrize("field, kwargs", [
    ("params.temperature", dict(temperature=math.nan)),
    ("params.top_p", dict(top_p=-0.5)),
    ("params.top_p", dict(top_p=1.5)),
    ("params.repetition_penalty", dict(repetition_penalty=-1.0)),
    ("params.min_p", dict(min_p=2.0)),
    ("params.frequency_penalty", dict(frequency_penalty=math.inf)),
])
def test_bad_fields_name_the_field(field, kwargs):
    with pytest.raises(InvalidArgument) as e:
        sampling_params_from_proto(common_pb2.SamplingParams(**kwargs), 16)
    assert e.value.field == field


def test_stop_token_outside_the_vocabulary():
    with pytest.raises(InvalidArgument) as e:
        sampling_params_from_proto(common_pb2.SamplingParams(stop_token_ids=[1, 600]), 16, vocab_size=512)
    assert e.value.field == "params.stop_token_ids[1]"
    assert sampling_params_from_proto(common_pb2.SamplingParams(stop_token_ids=[600]), 16).stop_token_ids == (600,)


@pytest.mark.parametrize("reason", [None, *FinishReason])
def test_sequence_output_round_trip(reason):
    out = SequenceOutput("r-1", [5, 6], [-0.25, -0.5], reason, num_prompt_tokens=7, num_cached_tokens=4,
                         error="boom" if reason is FinishReason.ERROR else "")
    wire = sequence_output_to_proto(out)
    assert wire.finish_reason == finish_reason_to_proto(reason)
    assert sequence_output_from_proto(wire) == out


def test_finish_reasons_and_the_routers_stop_string():
    assert finish_reason_to_proto(None) == common_pb2.FINISH_REASON_UNSPECIFIED
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    assert finish_reason_to_proto(FinishReason.STOP, stop_string=True) == common_pb2.FINISH_REASON_STOP_STRING
    assert finish_reason_to_proto(FinishReason.LENGTH, stop_string=True) == common_pb2.FINISH_REASON_LENGTH
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_STOP_STRING) is FinishReason.STOP
    assert finish_reason_name(FinishReason.STOP, True) == "FINISH_REASON_STOP_STRING"
    assert finish_reason_name(FinishReason.DEADLINE) == "FINISH_REASON_DEADLINE"
    for reason in FinishReason:
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason


def test_roles_and_identity():
    assert role_from_proto(common_pb2.ROLE_UNSPECIFIED) is None and role_to_proto(None) == common_pb2.ROLE_UNSPECIFIED
    for role in Role:
        assert role_from_proto(role_to_proto(role)) is role
    info = WorkerInfo("v1", Role.BOTH, "m", "bfloat16", 16, 1024, 99, "w-1", "0.1", 512)
    assert worker_info_from_proto(worker_info_to_proto(info)) == info


def test_worker_stats_carry_every_wire_field():
    fields = {f.name for f in worker_pb2.WorkerStats.DESCRIPTOR.fields}
    assert fields == set(WorkerStats.__dataclass_fields__), "WorkerStats and worker.proto disagree"
    wire = worker_pb2.WorkerStats(role=common_pb2.ROLE_DECODE, worker_id="w", chunked_prefill=True)
    for i, f in enumerate(sorted(fields - {"role", "worker_id", "chunked_prefill"})):
        setattr(wire, f, i + 1)
    stats = worker_stats_from_proto(wire)
    assert stats.role is Role.DECODE and stats.worker_id == "w" and stats.chunked_prefill
    assert all(getattr(stats, f) == getattr(wire, f) for f in fields - {"role"})


def test_reservation_and_first_token():
    res = reservation_from_proto(worker_pb2.ReserveResponse(block_ids=[3, 4], num_cached_tokens=16,
                                                            kv_store_address="kv:1", worker_id="d",
                                                            lease_expires_unix_ms=5))
    assert res == Reservation([3, 4], 16, "kv:1", "d", 5)
    ft = worker_pb2.FirstToken(token_id=9, logprob=-0.5, num_cached_tokens=32,
                               finish_reason=common_pb2.FINISH_REASON_LENGTH)
    assert first_token_from_proto(ft, "r", logprobs=True) == SequenceOutput(
        "r", [9], [-0.5], FinishReason.LENGTH, num_cached_tokens=32)
    assert first_token_from_proto(ft, "r", logprobs=False).logprobs == []


# ----------------------------------------------------------------------------- guides
GUIDE_CASES = [
    common_pb2.Guide(json_schema='{"type": "object", "properties": {"a": {"type": "integer"}}}'),
    common_pb2.Guide(json_object=True),
    common_pb2.Guide(regex="[a-z]+"),
    common_pb2.Guide(choice=common_pb2.GuideChoices(choices=["yes", "no"])),
    common_pb2.Guide(grammar='root ::= "a" | "b"'),
]


@pytest.mark.parametrize("guide", GUIDE_CASES)
def test_guide_round_trips(guide):
    s = sampling_params_from_proto(common_pb2.SamplingParams(guide=guide), rest_of_context=8)
    assert s.guide is not None
    assert sampling_params_to_proto(s).guide == guide


@pytest.mark.parametrize("guide, field", [
    (common_pb2.Guide(), "params.guide"),
    (common_pb2.Guide(json_object=False), "params.guide.json_object"),
    (common_pb2.Guide(json_schema="{oops"), "params.guide.json_schema"),
    (common_pb2.Guide(json_schema='"a string"'), "params.guide.json_schema"),
    (common_pb2.Guide(regex=""), "params.guide.regex"),
    (common_pb2.Guide(regex="(a"), "params.guide.regex"),
    (common_pb2.Guide(choice=common_pb2.GuideChoices()), "params.guide.choice"),
    (common_pb2.Guide(grammar="root ::= nothing"), "params.guide.grammar"),
])
def test_bad_guides_are_invalid_argument_naming_the_field(guide, field):
    with pytest.raises(InvalidArgument) as e:
        sampling_params_from_proto(common_pb2.SamplingParams(guide=guide), rest_of_context=8)
    assert e.value.field == field
