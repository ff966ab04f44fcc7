"""KServe v2 tensor contents <-> Python values.

A tensor's data travels either in ``contents`` (the repeated field of its datatype) or as
``raw_input_contents`` bytes: little-endian, row-major; a BYTES element is a 4-byte
little-endian length followed by that many bytes. FP16/BF16 are not taken (no knob needs them).
Errors are INVALID_ARGUMENT naming the tensor.
"""
from __future__ import annotations

import math
import struct
from typing import Any

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.kserve import grpc_predict_v2_pb2 as pb

# datatype -> (field of InferTensorContents, struct code of one raw element or "" for BYTES)
DATATYPES: dict[str, tuple[str, str]] = {
    "BOOL": ("bool_contents", "?"),
    "INT8": ("int_contents", "b"), "INT16": ("int_contents", "h"), "INT32": ("int_contents", "i"),
    "INT64": ("int64_contents", "q"),
    "UINT8": ("uint_contents", "B"), "UINT16": ("uint_contents", "H"), "UINT32": ("uint_contents", "I"),
    "UINT64": ("uint64_contents", "Q"),
    "FP32": ("fp32_contents", "f"), "FP64": ("fp64_contents", "d"),
    "BYTES": ("bytes_contents", ""),
}


def element_count(shape: Any, field: str) -> int:
    """The number of elements of ``shape`` (``[]`` = one scalar); dims must be >= 0."""
    if any(d < 0 for d in shape):
        raise InvalidArgument(f"{field}.shape", f"dimensions must be >= 0, got {list(shape)}")
    return math.prod(shape)


def _decode_raw_bytes(raw: bytes, field: str) -> list[bytes]:
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidArgument(field, "raw BYTES contents end inside a length prefix")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise InvalidArgument(field, "raw BYTES contents end inside an element")
        out.append(raw[pos:pos + n])
        pos += n
    return out


def encode_raw_bytes(values: list[bytes]) -> bytes:
    """BYTES elements as one raw contents entry: each a 4-byte little-endian length, then itself."""
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def decode(tensor: pb.ModelInferRequest.InferInputTensor, raw: bytes | None, field: str) -> list[Any]:
    """The flattened values of ``tensor`` (``raw``: its raw_input_contents entry, if used)."""
    if tensor.datatype not in DATATYPES:
        raise InvalidArgument(f"{field}.datatype",
                              f"unsupported datatype {tensor.datatype!r} (one of {', '.join(DATATYPES)})")
    contents_field, code = DATATYPES[tensor.datatype]
    if raw is None:
        values = list(getattr(tensor.contents, contents_field))
    elif code == "":
        values = _decode_raw_bytes(raw, field)
    else:
        size = struct.calcsize(code)
        if len(raw) % size:
            raise InvalidArgument(field, f"raw contents of {len(raw)} bytes are not a whole number of "
                                         f"{tensor.datatype} elements")
        values = list(struct.unpack(f"<{len(raw) // size}{code}", raw))
    expected = element_count(tensor.shape, field)
    if len(values) != expected:
        raise InvalidArgument(field, f"shape {list(tensor.shape)} needs {expected} element(s), got {len(values)}")
    return values

