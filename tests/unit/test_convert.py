"""The one SamplingParams converter: the zero rule of common.proto, the same for the router
and the workers; bad fields are INVALID_ARGUMENT naming params.<field>."""
from __future__ import annotations

import math

import pytest

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.common.grpc_utils.convert import (
    sampling_params_for_prompt,
    sampling_params_from_proto,
    sampling_params_to_proto,
)
from pdserve.router.validation import ParamsCache
from pdserve.v1 import common_pb2


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
