"""The OpenAI API's per-request latency objectives: the ``x-slo-ttft-ms`` and ``x-slo-tpot-ms``
headers (llm-d's names) become ``GenerateRequest.slo`` of every choice of the request
(pdserve.router.slo has the rules). A bad value is a 400 naming the header.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.router import slo
from pdserve.router.openai_api.errors import bad_request
from pdserve.v1 import router_pb2


def apply(inputs: Iterable[router_pb2.GenerateRequest], headers: Mapping[str, str]) -> None:
    """Set each header present (case-insensitive, as HTTP's) on every request of ``inputs``."""
    values: dict[str, float] = {}
    for name, field in slo.HEADERS.items():
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            values[field] = slo.parse_header(name, raw)
        except InvalidArgument as e:
            raise bad_request(name, str(e)[len(name) + 2:]) from None
    if values:
        for req in inputs:
            for field, value in values.items():
                setattr(req.slo, field, value)
