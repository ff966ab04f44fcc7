"""Admission control end to end (router + one worker of role both, embedded model, CPU).

The router runs with ``--max-waiting-requests 2`` (one worker: two requests may wait for their
first token; the SLO-derived bound off, so that the CPU's speed does not decide). Two long
prompts take both places; a burst through every front door while they prefill is refused at
once (gRPC Generate and KServe ModelInfer: RESOURCE_EXHAUSTED with ``retry-after`` trailing
metadata; the OpenAI API: 429 with ``Retry-After``; KServe ModelStreamInfer: an error response
with the ``retry_after`` parameter), far faster than an admitted request is answered; the
admitted ones complete, the router counts every refusal by reason, a request after the long
ones is admitted, and the worker's block pool ends whole.
"""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import grpc
import grpc.aio
import pytest

from bench import deployment as services
from pdserve.kserve import grpc_predict_v2_pb2 as kpb
from pdserve.kserve import grpc_predict_v2_pb2_grpc as kpb_grpc
from pdserve.loadtest.ports import free_port
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.kserve_requests import infer_request

LONG = 600                  # prompt tokens of each request holding a place (~0.5 s of prefill on CPU)
BURST = {"grpc": 6, "http": 6, "kserve": 3, "kserve-stream": 2}


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    http = free_port()
    bounds = ["--max-waiting-requests", "2", "--admission-slo-multiple", "0"]
    d = services.start(tmp_path_factory.mktemp("admission-logs"), num_prefill=0, num_decode=1, decode_role="both",
                       metrics=True, router_args=[*bounds, "--worker-timeout-s", "10", "--http-port", str(http)])
    d.http = f"http://127.0.0.1:{http}/v1"
    yield d
    d.stop()


def _long(seed: int) -> router_pb2.GenerateRequest:
    ids = [(1000 + 7 * i + seed) % 40000 + 100 for i in range(LONG)]   # no prefix shared with the other
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                      params=common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def _short() -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(text="The capital of France is",
                                      params=common_pb2.SamplingParams(temperature=0, max_tokens=4))


def _metadata(err: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: v for k, v in (err.trailing_metadata() or ())}


async def _timed(door: str, call) -> dict:
    t0 = time.monotonic()
    out = await call
    out.update(door=door, seconds=time.monotonic() - t0)
    return out


async def _grpc(stub) -> dict:
    try:
        await stub.GenerateUnary(_short(), timeout=120)
        return {"refused": False}
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        return {"refused": True, "retry_after": _metadata(e).get("retry-after"), "details": e.details()}


async def _http(session: aiohttp.ClientSession, url: str) -> dict:
    body = {"model": "default", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "stream": True}
    async with session.post(f"{url}/completions", json=body) as r:
        text = await r.text()
        if r.status == 200:
            return {"refused": False}
        assert r.status == 429, (r.status, text)
        error = json.loads(text)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "resource_exhausted", error
        return {"refused": True, "retry_after": r.headers.get("Retry-After"), "details": error["message"]}


def _infer(model: str) -> kpb.ModelInferRequest:
    return infer_request(kpb, model, "The capital of France is", max_tokens=4)


async def _kserve(stub, model: str) -> dict:
    try:
        await stub.ModelInfer(_infer(model), timeout=120)
        return {"refused": False}
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        return {"refused": True, "retry_after": _metadata(e).get("retry-after"), "details": e.details()}


async def _kserve_stream(stub, model: str, rid: str) -> dict:
    req = _infer(model)
    req.id = rid
    async for resp in stub.ModelStreamInfer(iter([req]), timeout=120):
        if resp.error_message:
            assert resp.error_message.startswith("RESOURCE_EXHAUSTED: ") and resp.infer_response.id == rid
            return {"refused": True, "retry_after": str(resp.infer_response.parameters["retry_after"].int64_param),
                    "details": resp.error_message}
        if resp.infer_response.parameters["triton_final_response"].bool_param:
            return {"refused": False}
    raise AssertionError("the stream ended without a final response")


async def _scenario(dep) -> tuple[list[dict], list[dict], dict]:
    async with grpc.aio.insecure_channel(dep.router) as ch, aiohttp.ClientSession() as session:
        stub, kstub = router_pb2_grpc.GenerationStub(ch), kpb_grpc.GRPCInferenceServiceStub(ch)
        model = (await stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=30)).model
        await stub.GenerateUnary(_short(), timeout=120)          # warm
        holders = [asyncio.ensure_future(_timed("holder", _grpc_long(stub, k))) for k in range(2)]
        await asyncio.sleep(0.2)                                  # both admitted, prefilling
        burst = [_timed("grpc", _grpc(stub)) for _ in range(BURST["grpc"])]
        burst += [_timed("http", _http(session, dep.http)) for _ in range(BURST["http"])]
        burst += [_timed("kserve", _kserve(kstub, model)) for _ in range(BURST["kserve"])]
        burst += [_timed("kserve-stream", _kserve_stream(kstub, model, f"s{k}")) for k in range(BURST["kserve-stream"])]
        answers = await asyncio.gather(*burst)
        held = await asyncio.gather(*holders)
        after = await _timed("after", _grpc(stub))                # the places are free again
    return answers, held, after


async def _grpc_long(stub, seed: int) -> dict:
    result = await stub.GenerateUnary(_long(seed), timeout=120)
    assert len(result.token_ids) == 4
    return {"refused": False}


def _refusals(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("pdserve_router_requests_refused_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_burst_over_the_bound_is_refused_at_once_on_every_door(dep):
    before = _refusals(dep.scrape("router"))
    answers, held, after = asyncio.run(_scenario(dep))
    print("burst", sorted((a["door"], a["refused"], round(a["seconds"], 3)) for a in answers),
          "held", held, "after", after)       # shown when the test fails
    refused = [a for a in answers if a["refused"]]
    assert {a["door"] for a in refused} == set(BURST), answers         # every door refuses
    assert len(refused) == len(answers), [a for a in answers if not a["refused"]]
    for a in refused:
        assert a["retry_after"] is not None and int(a["retry_after"]) >= 1, a
        assert "waiting-requests" in a["details"], a
    slowest_refusal = max(a["seconds"] for a in refused)
    fastest_holder = min(h["seconds"] for h in held)
    # refused while the admitted requests prefill: answered long before them
    assert slowest_refusal < 0.5 * fastest_holder, (slowest_refusal, fastest_holder)
    assert not after["refused"] and all(not h["refused"] for h in held)
    counted = _refusals(dep.scrape("router"))
    assert counted["waiting-requests"] - before.get("waiting-requests", 0) == len(refused)
    assert counted.get("slo-ttft", 0) == before.get("slo-ttft", 0)
    dep.wait_whole(dep.decode[0])
