"""A request's own latency objectives (pdserve/router/slo.py): the checks, the three front doors
(gRPC ``GenerateRequest.slo``, the OpenAI ``x-slo-*`` headers, KServe parameters), the placement's
tightened objectives with hand-computed cases, and the trip to the decode worker's Sequence."""
from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.grpc_utils import InvalidArgument
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.broadcast import Broadcast
from pdserve.decode_worker.state import DecodeState
from pdserve.decode_worker.validation import check_tpot_slo
from pdserve.kserve import grpc_predict_v2_pb2 as pb
from pdserve.router import slo
from pdserve.router.fleet_policy import FleetWorker, pick_decode
from pdserve.router.kserve.convert import to_generate
from pdserve.router.openai_api import slo_headers
from pdserve.router.openai_api.errors import ApiError
from pdserve.router.pd_policy import PdConfig
from pdserve.v1 import router_pb2
from tests.kserve_requests import infer_request

CFG = PdConfig(mode="fleet", slo_ttft_ms=1000.0, slo_tpot_ms=12.0)


def test_a_request_only_tightens_the_routers_objectives():
    assert slo.tighten(CFG, slo.NONE) is CFG                          # nothing set: the same object
    assert slo.tighten(CFG, slo.RequestSlo(tpot_ms=50.0)) is CFG      # looser than the router's: ignored
    t = slo.tighten(CFG, slo.RequestSlo(ttft_ms=400.0))
    assert (t.slo_ttft_ms, t.slo_tpot_ms) == (400.0, 12.0)
    t = slo.tighten(CFG, slo.RequestSlo(ttft_ms=2000.0, tpot_ms=8.0))
    assert (t.slo_ttft_ms, t.slo_tpot_ms, t.mode) == (1000.0, 8.0, "fleet")


def test_a_tighter_tpot_changes_the_decode_pick():
    # home b decodes 3 rows at 7.8 ms, c 6 at 5 ms
    b = FleetWorker("b", 1000, tokens_per_s=40_000.0, decode_rows=3, decode_step_ms=7.8)
    c = FleetWorker("c", 1000, tokens_per_s=40_000.0, decode_rows=6, decode_step_ms=5.0)
    # router's 12 ms: home's step is within the guard's goal (7.8 <= 11.4) and keeps it
    assert pick_decode([b, c], slo.tighten(CFG, slo.NONE).slo_tpot_ms, home="b") is b
    # the request's 8 ms: home's step breaks the goal (7.8 > 7.6), c has room (5 <= 0.7 * 8)
    assert pick_decode([b, c], slo.tighten(CFG, slo.RequestSlo(tpot_ms=8.0)).slo_tpot_ms, home="b") is c


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, slo.MAX_SLO_MS + 1])
def test_bad_values_name_the_field(value):
    with pytest.raises(InvalidArgument) as e:
        slo.from_proto(router_pb2.RequestSlo(ttft_ms=1.0, tpot_ms=value))
    assert e.value.field == "slo.tpot_ms"
    with pytest.raises(InvalidArgument) as e:
        check_tpot_slo(value)                   # the decode worker checks it as from a stranger
    assert e.value.field == "tpot_slo_ms"


def test_grpc_field_unset_or_zero_is_the_routers():
    assert slo.from_proto(None) == slo.NONE
    assert slo.from_proto(router_pb2.RequestSlo()) == slo.NONE
    assert slo.from_proto(router_pb2.RequestSlo(tpot_ms=9.5)) == slo.RequestSlo(0.0, 9.5)
    check_tpot_slo(0.0)
    check_tpot_slo(9.5)


def test_openai_headers_set_every_choice():
    reqs = [router_pb2.GenerateRequest(text="a"), router_pb2.GenerateRequest(text="b")]
    slo_headers.apply(reqs, {"x-slo-tpot-ms": " 10 ", "x-slo-ttft-ms": "250"})
    assert [(r.slo.ttft_ms, r.slo.tpot_ms) for r in reqs] == [(250.0, 10.0), (250.0, 10.0)]
    plain = router_pb2.GenerateRequest(text="c")
    slo_headers.apply([plain], {"authorization": "Bearer x"})
    assert not plain.HasField("slo")
    for bad in ("fast", "-3", "nan"):
        with pytest.raises(ApiError) as e:
            slo_headers.apply(reqs, {"x-slo-tpot-ms": bad})
        assert e.value.status == 400 and e.value.param == "x-slo-tpot-ms", e.value.message


def test_kserve_parameters():
    call = to_generate(infer_request(pb, "m", "hi", "r1", slo_ttft_ms=300.0, slo_tpot_ms=9), default_stream=True)
    assert (call.request.slo.ttft_ms, call.request.slo.tpot_ms) == (300.0, 9.0)
    with pytest.raises(InvalidArgument) as e:
        to_generate(infer_request(pb, "m", "hi", "r1", slo_tpot_ms=-2.0), default_stream=True)
    assert e.value.field == "parameters.slo_tpot_ms"
    with pytest.raises(InvalidArgument) as e:
        to_generate(infer_request(pb, "m", "hi", "r1", slo_tpot_ms="soon"), default_stream=True)
    assert "slo_tpot_ms" in str(e.value)


class _Outputs(Broadcast):
    def __init__(self) -> None:
        super().__init__(asyncio.new_event_loop())

    def publish(self, key, item) -> bool:
        return True


def test_the_decode_worker_gives_the_sequence_its_objective():
    engine = LLMEngine(EngineConfig(model="tiny-qwen3", device="cpu", num_kv_blocks=32, block_size=16))
    state = DecodeState(_Outputs(), default_lease_ms=1000)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    state.submit(engine, "local", list(range(3, 40)), params, None, "router", tpot_slo_ms=8.0)
    state.reserve(engine, "remote", list(range(5, 50)), params, 0, None, "router", 7.5)
    state.submit(engine, "plain", list(range(3, 20)), params, None, "router")
    got = {rid: state.tracked[rid].seq.tpot_slo_ms for rid in ("local", "remote", "plain")}
    assert got == {"local": 8.0, "remote": 7.5, "plain": 0.0}
