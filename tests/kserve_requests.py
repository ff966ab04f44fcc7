"""KServe v2 requests for the tests, built with whichever generated module ``pb`` they pass
(pdserve's stubs, or a client generated from protos/ inside a test)."""
from __future__ import annotations


def set_parameter(p, value: bool | int | float | str) -> None:
    """One InferParameter of the request, typed by the Python value."""
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = value


def infer_request(pb, model: str, text: str | None, request_id: str = "", **params):
    """A ModelInferRequest with a BYTES ``text_input`` (none if ``text`` is None) and parameters."""
    req = pb.ModelInferRequest(model_name=model, id=request_id)
    if text is not None:
        req.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(text.encode())
    for name, value in params.items():
        set_parameter(req.parameters[name], value)
    return req
