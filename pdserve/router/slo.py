"""A request's own latency objectives (``GenerateRequest.slo``; the OpenAI API's ``x-slo-ttft-ms``
and ``x-slo-tpot-ms`` headers; KServe's ``slo_ttft_ms`` and ``slo_tpot_ms`` parameters).

Rules:
- each objective is optional: 0 = not set, the router's own (``--slo-ttft-ms``, ``--slo-tpot-ms``);
- a set objective must be finite and in (0, MAX_SLO_MS]: InvalidArgument naming ``slo.<field>``;
- a request can only tighten the router's objectives: placement plans with
  ``min(router, request)`` (:func:`tighten`), and the decode worker's TPOT guard with
  ``min(--tpot-target-ms, request)`` (the request's value travels in Reserve and Submit).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.router.pd_policy import PdConfig

MAX_SLO_MS = 3_600_000.0        # one hour: anything longer is no objective
HEADERS = {"x-slo-ttft-ms": "ttft_ms", "x-slo-tpot-ms": "tpot_ms"}     # HTTP header -> field


def check(field: str, value: float) -> float:
    """``value`` when it is 0 or in (0, MAX_SLO_MS]; InvalidArgument naming ``field`` otherwise."""
    if not math.isfinite(value) or not 0.0 <= value <= MAX_SLO_MS:
        raise InvalidArgument(field, f"must be 0 (unset) or a finite number of ms up to {MAX_SLO_MS:g}, "
                                     f"not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class RequestSlo:
    ttft_ms: float = 0.0        # 0 = the router's
    tpot_ms: float = 0.0        # 0 = the router's

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            check(f"slo.{name}", getattr(self, name))


NONE = RequestSlo()


def from_proto(msg) -> RequestSlo:
    """The validated objectives of a ``pdserve.v1.RequestSlo`` (None or unset: NONE)."""
    if msg is None:
        return NONE
    return RequestSlo(float(msg.ttft_ms), float(msg.tpot_ms))


def parse_header(name: str, value: str) -> float:
    """One ``x-slo-*`` header's value in ms (InvalidArgument naming the header when it is not a number
    in range)."""
    try:
        number = float(value.strip())
    except ValueError:
        raise InvalidArgument(name, f"must be a number of ms, not {value!r}") from None
    return check(name, number)


def tighten(cfg: PdConfig, slo: RequestSlo) -> PdConfig:
    """``cfg`` with each objective the smaller of the router's and the request's (the same ``cfg``
    object when the request sets none, so the common path allocates nothing)."""
    ttft = min(cfg.slo_ttft_ms, slo.ttft_ms) if slo.ttft_ms > 0 else cfg.slo_ttft_ms
    tpot = min(cfg.slo_tpot_ms, slo.tpot_ms) if slo.tpot_ms > 0 else cfg.slo_tpot_ms
    if ttft == cfg.slo_ttft_ms and tpot == cfg.slo_tpot_ms:
        return cfg
    return replace(cfg, slo_ttft_ms=ttft, slo_tpot_ms=tpot)
