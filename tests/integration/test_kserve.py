"""The router's KServe Open Inference Protocol v2 service, driven by a client that knows only
the protocol: its stubs are generated here, in the test, from protos/inference/ alone.

Against ``pdserve up`` (router + prefill + decode processes, embedded model, CPU):
ModelStreamInfer streams the same greedy text as ``pdserve.v1.Generation/Generate`` (one
response per engine step, the last one marked final); ModelInfer answers in one response
whether the knobs come as parameters or as (raw) input tensors; metadata describes the
tensors; readiness agrees with grpc.health.v1; bad parameters get INVALID_ARGUMENT naming
them (on the stream: an ``error_message`` and the stream goes on); a cancelled stream leaves
both workers' block pools whole.
"""
from __future__ import annotations

import importlib
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_tools import protoc

from bench import deployment as services
from pdserve.v1 import common_pb2, router_pb2
from tests.kserve_requests import infer_request

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def kserve(tmp_path_factory) -> SimpleNamespace:
    """``pb`` and ``pb_grpc``: the protocol's stubs, generated from the .proto only."""
    out = tmp_path_factory.mktemp("kserve-client")
    rc = protoc.main(["grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(ROOT / "protos" / "inference" / "grpc_predict_v2.proto")])
    assert rc == 0
    sys.path.insert(0, str(out))
    try:
        yield SimpleNamespace(pb=importlib.import_module("inference.grpc_predict_v2_pb2"),
                              pb_grpc=importlib.import_module("inference.grpc_predict_v2_pb2_grpc"))
    finally:
        sys.path.remove(str(out))


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = services.start_up(tmp_path_factory.mktemp("kserve-logs"))      # `pdserve up`
    yield d
    d.stop()


@pytest.fixture(scope="module")
def channel(dep):
    with grpc.insecure_channel(dep.router) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(kserve, channel):
    return kserve.pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def model(dep) -> str:
    """The served model's name (asked over pdserve.v1: the KServe client is told it, as any client is)."""
    return dep.router_stub().GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=30).model


def _request(kserve, model: str, text: str, request_id: str = "", **params):
    return infer_request(kserve.pb, model, text, request_id, **params)


def _text(response) -> str:
    """text_output's text: typed contents, or length-prefixed raw_output_contents (one element)."""
    (out,) = [o for o in response.outputs if o.name == "text_output"]
    assert out.datatype == "BYTES"
    if response.raw_output_contents:
        (raw,) = response.raw_output_contents
        (n,) = struct.unpack_from("<I", raw)
        assert len(raw) == 4 + n
        return raw[4:].decode()
    return b"".join(out.contents.bytes_contents).decode()


def _generate(dep, text: str, max_tokens: int) -> list[router_pb2.GenerateResponse]:
    req = router_pb2.GenerateRequest(text=text, params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))
    return list(dep.router_stub().Generate(req, timeout=120))


def test_stream_infer_streams_the_generate_tokens(dep, kserve, stub, model):
    responses = list(stub.ModelStreamInfer(iter([_request(kserve, model, PROMPT, "paris", max_tokens=12,
                                                          temperature=0.0)]), timeout=120))
    assert all(not r.error_message for r in responses)
    infer = [r.infer_response for r in responses]
    assert {r.id for r in infer} == {"paris"} and {r.model_name for r in infer} == {model}
    finals = [r.parameters["triton_final_response"].bool_param for r in infer]
    assert finals == [False] * (len(infer) - 1) + [True]
    text = "".join(_text(r) for r in infer)
    assert "Paris" in text, text
    want = _generate(dep, PROMPT, 12)
    assert text == "".join(w.text for w in want)
    assert 1 < len(infer) <= 12                         # streamed: a response per engine step (steps a
                                                        # slow reader sees late may carry several tokens)
    last = infer[-1].parameters
    assert last["finish_reason"].string_param == "length"
    assert last["completion_tokens"].int64_param == want[-1].usage.completion_tokens == 12
    assert last["prompt_tokens"].int64_param == want[-1].usage.prompt_tokens


def test_model_infer_takes_knobs_as_parameters_or_raw_tensors(dep, kserve, stub, model):
    want = "".join(w.text for w in _generate(dep, PROMPT, 8))
    r = stub.ModelInfer(_request(kserve, model, PROMPT, max_tokens=8, temperature=0.0), timeout=120)
    assert _text(r) == want and r.parameters["finish_reason"].string_param == "length"
    assert r.parameters["triton_final_response"].bool_param
    pb = kserve.pb          # Triton's clients send raw contents: length-prefixed BYTES, little-endian numbers
    req = pb.ModelInferRequest(model_name=model, model_version="1")
    req.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    req.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    req.inputs.add(name="temperature", datatype="FP32", shape=[1, 1])
    req.raw_input_contents.extend([struct.pack("<I", len(PROMPT.encode())) + PROMPT.encode(),
                                   struct.pack("<i", 8), struct.pack("<f", 0.0)])
    req.outputs.add(name="text_output")
    raw = stub.ModelInfer(req, timeout=120)                 # raw in, raw out (where Triton's clients read it)
    assert len(raw.raw_output_contents) == 1 and not raw.outputs[0].HasField("contents")
    assert _text(raw) == want
    streamed_once = list(stub.ModelStreamInfer(iter([_request(kserve, model, PROMPT, max_tokens=8, temperature=0.0,
                                                              stream=False)]), timeout=120))
    assert len(streamed_once) == 1 and _text(streamed_once[0].infer_response) == want


def test_metadata_and_readiness_agree_with_grpc_health(kserve, stub, channel, model):
    pb = kserve.pb
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name=model), timeout=30)
    inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
    assert inputs["text_input"] == ("BYTES", [1]) and inputs["stream"] == ("BOOL", [1])
    assert {"max_tokens", "temperature", "top_p", "top_k", "stop"} <= set(inputs)
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]
    assert meta.versions == ["1"] and meta.platform == "pdserve"
    server = stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=30)
    assert server.name == "pdserve" and "model_stream_infer" in server.extensions
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    serving = health.status == health_pb2.HealthCheckResponse.SERVING
    assert serving
    assert stub.ServerLive(pb.ServerLiveRequest(), timeout=30).live
    assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready == serving
    assert stub.ModelReady(pb.ModelReadyRequest(name=model), timeout=30).ready == serving
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelReady(pb.ModelReadyRequest(name=model, version="7"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("params, named", [
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"stream": 1}, "stream"),
])
def test_bad_parameters_are_invalid_argument_naming_them(kserve, stub, model, params, named):
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(_request(kserve, model, "hi", **params), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value.details()
    bad = _request(kserve, model, "hi", "bad", **params)   # on the stream: an error_message, and it goes on
    good = _request(kserve, model, PROMPT, "good", max_tokens=2, temperature=0.0)
    responses = list(stub.ModelStreamInfer(iter([bad, good]), timeout=60))
    errors = [r for r in responses if r.error_message]
    assert len(errors) == 1 and errors[0].infer_response.id == "bad"
    assert errors[0].error_message.startswith("INVALID_ARGUMENT: ") and named in errors[0].error_message
    ok = [r.infer_response for r in responses if not r.error_message]
    assert ok and {r.id for r in ok} == {"good"} and ok[-1].parameters["triton_final_response"].bool_param


def test_bad_tensors_and_models_are_refused(kserve, stub, model):
    pb = kserve.pb
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelMetadata(pb.ModelMetadataRequest(name="no-such-model"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and model in e.value.details()
    no_text = pb.ModelInferRequest(model_name=model)
    unknown = _request(kserve, model, "hi")
    unknown.inputs.add(name="colour", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"red")
    wrong_shape = _request(kserve, model, "hi")
    wrong_shape.inputs[0].shape[:] = [2]
    for req, named in [(no_text, "text_input"), (unknown, "colour"), (wrong_shape, "text_input")]:
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and named in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(_request(kserve, "no-such-model", "hi"), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_cancelled_stream_frees_both_pools(dep, kserve, stub, model):
    call = stub.ModelStreamInfer(iter([_request(kserve, model, "Tell me a long story.", max_tokens=400,
                                                ignore_eos=True)]), timeout=120)
    got = 0
    for r in call:
        assert not r.error_message
        got += 1
        if got >= 3:
            break
    call.cancel()
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])


def test_one_stream_carries_concurrent_requests(dep, kserve, stub, model):
    prompts = {"a": PROMPT, "b": "Name three primary colors."}
    reqs = [_request(kserve, model, text, rid, max_tokens=10, temperature=0.0) for rid, text in prompts.items()]
    texts: dict[str, str] = {"a": "", "b": ""}
    finals = []
    for r in stub.ModelStreamInfer(iter(reqs), timeout=120):
        assert not r.error_message
        texts[r.infer_response.id] += _text(r.infer_response)
        if r.infer_response.parameters["triton_final_response"].bool_param:
            finals.append(r.infer_response.id)
    assert sorted(finals) == ["a", "b"]
    for rid, text in prompts.items():
        assert texts[rid] == "".join(w.text for w in _generate(dep, text, 10))


def test_stream_past_its_deadline_frees_both_pools(dep, kserve, stub, model):
    call = stub.ModelStreamInfer(iter([_request(kserve, model, "Tell me a long story.", max_tokens=400,
                                                ignore_eos=True)]), timeout=1.5)
    try:
        responses = list(call)
    except grpc.RpcError as e:                  # the call's deadline ended the stream
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    else:                                       # the flow saw the request's deadline first
        last = responses[-1]
        assert (last.error_message.startswith("DEADLINE_EXCEEDED")
                or last.infer_response.parameters["finish_reason"].string_param == "deadline"), last
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])
