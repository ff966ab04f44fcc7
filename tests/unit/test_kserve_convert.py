"""pdserve.router.kserve: KServe v2 tensors and requests -> pdserve.v1 GenerateRequest, and responses."""
from __future__ import annotations

import struct

import pytest

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.common.outputs import FinishReason
from pdserve.kserve import grpc_predict_v2_pb2 as pb
from pdserve.router.kserve.convert import finish_name, to_generate, to_infer_response
from pdserve.router.kserve.tensors import decode
from pdserve.router.output import TextOutput
from tests.kserve_requests import infer_request


def _req(text: str | None = "hi", **params) -> pb.ModelInferRequest:
    return infer_request(pb, "m", text, "r1", **params)


def test_parameters_become_sampling_params():
    call = to_generate(_req("Hello", max_tokens=7, temperature=0.5, top_k=3, seed=11, ignore_eos=True,
                            stop="\n", stream=False, priority=2), default_stream=True)
    r = call.request
    assert r.text == "Hello" and r.request_id == "r1" and not call.stream
    assert (r.params.max_tokens, r.params.temperature, r.params.top_k, r.params.seed) == (7, 0.5, 3, 11)
    assert r.params.ignore_eos and list(r.params.stop) == ["\n"]
    assert to_generate(_req(), default_stream=True).stream      # the default of the rpc
    assert to_generate(_req(min_tokens=4), default_stream=True).request.params.min_tokens == 4
    assert to_generate(_req(min_length=2), default_stream=True).request.params.min_tokens == 2   # TensorRT-LLM's


def test_knobs_as_tensors_typed_and_raw():
    req = _req("Hello")
    req.inputs.add(name="temperature", datatype="FP32", shape=[1]).contents.fp32_contents.append(0.25)
    req.inputs.add(name="stop_words", datatype="BYTES", shape=[2]).contents.bytes_contents.extend([b"a", b"bc"])
    req.inputs.add(name="stream", datatype="BOOL", shape=[1]).contents.bool_contents.append(False)
    call = to_generate(req, default_stream=True)
    assert call.request.params.temperature == 0.25 and list(call.request.params.stop) == ["a", "bc"]
    assert not call.stream and not call.raw_output
    raw = pb.ModelInferRequest(model_name="m")
    raw.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    raw.inputs.add(name="random_seed", datatype="UINT64", shape=[1, 1])
    raw.raw_input_contents.extend([struct.pack("<I", 3) + b"abc", struct.pack("<Q", 2**40)])
    call = to_generate(raw, default_stream=False)
    assert call.request.text == "abc" and call.request.params.seed == 2**40
    assert call.raw_output                                  # raw in, raw out


@pytest.mark.parametrize("mutate, named", [
    (lambda r: r.parameters["temperature"].MergeFrom(pb.InferParameter(string_param="hot")),
     "parameters.temperature"),
    (lambda r: r.parameters["max_tokens"].MergeFrom(pb.InferParameter(double_param=3.0)), "parameters.max_tokens"),
    (lambda r: r.parameters["max_tokens"].MergeFrom(pb.InferParameter(int64_param=-1)), "max_tokens"),
    (lambda r: r.parameters["stream"].MergeFrom(pb.InferParameter(int64_param=1)), "parameters.stream"),
    (lambda r: r.inputs.add(name="colour", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"x"),
     "inputs.colour"),
    (lambda r: r.inputs.add(name="top_k", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0),
     "inputs.top_k.datatype"),
    (lambda r: r.inputs[0].shape.__setitem__(0, 2), "inputs.text_input"),
    (lambda r: r.outputs.add(name="logits"), "outputs[0].name"),
    (lambda r: r.raw_input_contents.append(b"\x01"), "raw_input_contents"),
])
def test_bad_requests_name_the_part(mutate, named):
    req = _req()
    mutate(req)
    with pytest.raises(InvalidArgument) as e:
        to_generate(req, default_stream=True)
    assert str(e.value).startswith(named), str(e.value)


def test_missing_or_bad_prompt():
    with pytest.raises(InvalidArgument, match="inputs.text_input"):
        to_generate(_req(None), default_stream=True)
    req = _req(None)
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"\xff")
    with pytest.raises(InvalidArgument, match="UTF-8"):
        to_generate(req, default_stream=True)
    both = _req(temperature=0.5)
    both.inputs.add(name="temperature", datatype="FP32", shape=[1]).contents.fp32_contents.append(0.5)
    with pytest.raises(InvalidArgument, match="temperature"):
        to_generate(both, default_stream=True)


def test_decode_raw_and_typed():
    t = pb.ModelInferRequest.InferInputTensor(name="x", datatype="INT32", shape=[3])
    assert decode(t, struct.pack("<3i", 1, -2, 3), "x") == [1, -2, 3]
    t.contents.int_contents.extend([4, 5, 6])
    assert decode(t, None, "x") == [4, 5, 6]
    with pytest.raises(InvalidArgument, match="whole number"):
        decode(t, b"\x00" * 5, "x")
    b = pb.ModelInferRequest.InferInputTensor(name="s", datatype="BYTES", shape=[2])
    assert decode(b, struct.pack("<I", 1) + b"a" + struct.pack("<I", 0), "s") == [b"a", b""]
    with pytest.raises(InvalidArgument, match="inside an element"):
        decode(b, struct.pack("<I", 9) + b"a", "s")
    with pytest.raises(InvalidArgument, match="unsupported datatype"):
        decode(pb.ModelInferRequest.InferInputTensor(name="h", datatype="FP16", shape=[1]), b"\x00\x00", "h")


def test_infer_response_marks_the_final_one():
    mid = to_infer_response("m", "1", "r1", "Par", None)
    assert mid.outputs[0].name == "text_output" and mid.outputs[0].contents.bytes_contents == [b"Par"]
    assert mid.parameters["triton_final_response"].bool_param is False and "finish_reason" not in mid.parameters
    last = TextOutput("r1", [7, 8], finish_reason=FinishReason.STOP, num_prompt_tokens=5, num_output_tokens=2,
                      matched_stop="\n")       # ended by a stop string
    end = to_infer_response("m", "1", "r1", "is", last)
    assert end.parameters["triton_final_response"].bool_param and end.parameters["finish_reason"].string_param == "stop"
    assert (end.parameters["prompt_tokens"].int64_param, end.parameters["completion_tokens"].int64_param) == (5, 2)
    assert finish_name(FinishReason.LENGTH) == "length" and finish_name(FinishReason.DEADLINE) == "deadline"
    raw = to_infer_response("m", "1", "r1", "Paris", None, raw=True)     # length-prefixed, as Triton's clients read it
    assert raw.raw_output_contents == [struct.pack("<I", 5) + b"Paris"] and not raw.outputs[0].HasField("contents")
    tensor = pb.ModelInferRequest.InferInputTensor(name="t", datatype="BYTES", shape=[1])
    assert decode(tensor, raw.raw_output_contents[0], "t") == [b"Paris"]
