"""ModelInferRequest -> pdserve.v1 GenerateRequest, and the flow's outputs -> ModelInferResponse.

Triton's LLM conventions: prompt in BYTES input ``text_input``; each knob (:data:`KNOBS`) as a
request parameter or a one-element input tensor (not both); the request's own latency objectives
as the parameters ``slo_ttft_ms`` / ``slo_tpot_ms`` (:data:`SLO_PARAMS`); output BYTES
``text_output`` (raw when the request was raw). Unknown parameters are ignored, unknown tensors refused; type errors
raise INVALID_ARGUMENT naming the parameter (ranges: pdserve.router.validation).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.common.outputs import FinishReason
from pdserve.kserve import grpc_predict_v2_pb2 as pb
from pdserve.router.kserve.tensors import decode, encode_raw_bytes
from pdserve.router.output import TextOutput
from pdserve.router.slo import check as check_slo
from pdserve.v1 import common_pb2, router_pb2

TEXT_INPUT = "text_input"
TEXT_OUTPUT = "text_output"
STREAM = "stream"
FINAL = "triton_final_response"

# knob name -> (SamplingParams field, kind); kind is "float", "int", "bool" or "strings"
KNOBS: dict[str, tuple[str, str]] = {
    "max_tokens": ("max_tokens", "int"),
    "temperature": ("temperature", "float"),
    "top_p": ("top_p", "float"),
    "top_k": ("top_k", "int"),
    "min_p": ("min_p", "float"),
    "repetition_penalty": ("repetition_penalty", "float"),
    "presence_penalty": ("presence_penalty", "float"),
    "frequency_penalty": ("frequency_penalty", "float"),
    "seed": ("seed", "int"),
    "random_seed": ("seed", "int"),         # TensorRT-LLM's name
    "ignore_eos": ("ignore_eos", "bool"),
    "min_tokens": ("min_tokens", "int"),
    "min_length": ("min_tokens", "int"),    # TensorRT-LLM's name
    "stop": ("stop", "strings"),
    "stop_words": ("stop", "strings"),      # TensorRT-LLM's name
}
# per-request latency objectives (float parameters, ms) -> GenerateRequest.slo field (pdserve.router.slo)
SLO_PARAMS: dict[str, str] = {"slo_ttft_ms": "ttft_ms", "slo_tpot_ms": "tpot_ms"}
# The tensor datatypes each kind is read from.
KIND_DATATYPES = {
    "int": ("INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"),
    "float": ("FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"),
    "bool": ("BOOL",),
    "strings": ("BYTES",),
}


@dataclass(frozen=True)
class InferCall:
    """A converted request: what to generate, and how to answer."""

    request: router_pb2.GenerateRequest
    stream: bool
    model_version: str
    raw_output: bool = False        # answer text_output in raw_output_contents


def _param_value(name: str, p: pb.InferParameter, kind: str) -> Any:
    field = p.WhichOneof("parameter_choice")
    value = getattr(p, field) if field else None
    ok = {
        "int": field in ("int64_param", "uint64_param"),
        "float": field in ("double_param", "int64_param", "uint64_param"),
        "bool": field == "bool_param",
        "strings": field == "string_param",
    }[kind]
    if not ok:
        raise InvalidArgument(f"parameters.{name}", f"expected a {kind} value, got {field or 'nothing'}")
    return [value] if kind == "strings" else value


def _tensor_value(name: str, values: list[Any], datatype: str, kind: str) -> Any:
    field = f"inputs.{name}"
    if datatype not in KIND_DATATYPES[kind]:
        raise InvalidArgument(f"{field}.datatype", f"expected one of {', '.join(KIND_DATATYPES[kind])}, "
                                                   f"got {datatype}")
    if kind == "strings":
        return [_utf8(v, field) for v in values]
    if len(values) != 1:
        raise InvalidArgument(field, f"expected one element, got {len(values)}")
    return values[0]


def _utf8(value: bytes, field: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(field, f"not valid UTF-8: {e}") from None


def _input_tensors(req: pb.ModelInferRequest) -> dict[str, tuple[list[Any], str]]:
    """name -> (values, datatype) of every input tensor."""
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise InvalidArgument("raw_input_contents", f"has {len(raw)} entries for {len(req.inputs)} inputs")
    if raw and any(t.HasField("contents") for t in req.inputs):
        raise InvalidArgument("raw_input_contents", "must not be used with typed contents in inputs")
    out: dict[str, tuple[list[Any], str]] = {}
    for i, t in enumerate(req.inputs):
        if t.name in out:
            raise InvalidArgument(f"inputs.{t.name}", "given twice")
        out[t.name] = (decode(t, raw[i] if raw else None, f"inputs.{t.name}"), t.datatype)
    return out


def _prompt(tensors: dict[str, tuple[list[Any], str]]) -> str:
    if TEXT_INPUT not in tensors:
        raise InvalidArgument(f"inputs.{TEXT_INPUT}", "required: a BYTES tensor holding the prompt")
    values, datatype = tensors.pop(TEXT_INPUT)
    if datatype != "BYTES" or len(values) != 1:
        raise InvalidArgument(f"inputs.{TEXT_INPUT}", f"must be one BYTES element, got {len(values)} {datatype}")
    return _utf8(values[0], f"inputs.{TEXT_INPUT}")


def _set_knob(params: common_pb2.SamplingParams, name: str, value: Any) -> None:
    field, kind = KNOBS[name]
    if kind == "strings":
        params.stop.extend(value)
        return
    try:
        setattr(params, field, value)
    except (ValueError, TypeError) as e:      # e.g. a negative max_tokens into a uint32
        raise InvalidArgument(name, f"out of range: {value!r} ({e})") from None


def to_generate(req: pb.ModelInferRequest, default_stream: bool) -> InferCall:
    """The GenerateRequest (and answer mode) of ``req``; raises InvalidArgument naming the part."""
    tensors = _input_tensors(req)
    text = _prompt(tensors)
    params = common_pb2.SamplingParams()
    stream = default_stream
    for name, (values, datatype) in tensors.items():
        if name == STREAM:
            stream = bool(_tensor_value(name, values, datatype, "bool"))
        elif name in KNOBS:
            if name in req.parameters:
                raise InvalidArgument(name, "given both as a parameter and as an input tensor")
            _set_knob(params, name, _tensor_value(name, values, datatype, KNOBS[name][1]))
        else:
            raise InvalidArgument(f"inputs.{name}", f"unknown input (known: {TEXT_INPUT}, {STREAM}, "
                                                    f"{', '.join(KNOBS)})")
    slo = router_pb2.RequestSlo()
    for name, p in req.parameters.items():
        if name == STREAM:
            stream = _param_value(name, p, "bool")
        elif name in KNOBS:
            _set_knob(params, name, _param_value(name, p, KNOBS[name][1]))
        elif name in SLO_PARAMS:
            setattr(slo, SLO_PARAMS[name], check_slo(f"parameters.{name}", _param_value(name, p, "float")))
    for i, o in enumerate(req.outputs):
        if o.name != TEXT_OUTPUT:
            raise InvalidArgument(f"outputs[{i}].name", f"unknown output {o.name!r} (only {TEXT_OUTPUT})")
    request = router_pb2.GenerateRequest(request_id=req.id, text=text, params=params, slo=slo)
    return InferCall(request, stream, req.model_version, raw_output=bool(req.raw_input_contents))


def finish_name(reason: FinishReason | None) -> str:
    """``stop`` / ``length`` / ``cancelled`` / ``deadline`` / ``error`` (a stop string ends with
    ``stop``); ``unspecified`` for None."""
    return reason.value if reason is not None else "unspecified"


def to_infer_response(model: str, version: str, request_id: str, text: str,
                      last: TextOutput | None, raw: bool = False) -> pb.ModelInferResponse:
    """A response carrying ``text`` (in ``raw_output_contents`` when ``raw``); ``last``: the
    request's final output, if this is the final response (finish reason and token counts go
    into its parameters)."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=request_id)
    out = resp.outputs.add(name=TEXT_OUTPUT, datatype="BYTES", shape=[1])
    if raw:
        resp.raw_output_contents.append(encode_raw_bytes([text.encode("utf-8")]))
    else:
        out.contents.bytes_contents.append(text.encode("utf-8"))
    resp.parameters[FINAL].bool_param = last is not None
    if last is not None:
        resp.parameters["finish_reason"].string_param = finish_name(last.finish_reason)
        resp.parameters["prompt_tokens"].int64_param = last.num_prompt_tokens
        resp.parameters["completion_tokens"].int64_param = last.num_output_tokens
    return resp
