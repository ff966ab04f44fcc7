"""``--pd-policy fleet`` as separate processes on the CPU (embedded model, Gloo): a router in front
of two workers of role both, each running the TPOT guard. Per request the router picks the worker
that decodes and the worker that prefills: a prompt no worker holds is prefilled where it decodes
(local, co-location's path); while the worker that holds a long prefix decodes another stream, a
prompt with that prefix and a tight objective of its own (TPOT: that worker has no room; TTFT:
nowhere keeps it, so the fastest place prefills) decodes on the other worker and is prefilled where
the prefix is cached, its KV shipped (cross-worker). Greedy outputs equal the offline engine's,
and both pools end whole, also after a cancel in each path. A request's own latency objectives
(gRPC ``slo``, the OpenAI API's ``x-slo-*`` headers) are served, and bad ones refused naming the
field.
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import grpc
import pytest

from bench import deployment as services
from pdserve.common.engine import LLM, SamplingParams
from pdserve.loadtest.ports import free_port
from pdserve.v1 import common_pb2, router_pb2

MAX_TOKENS = 10
SYSTEM = ("You are a careful expert in glacier physics; answer briefly, cite sources on ice flow exactly, and "
          "when unsure about crevasses, moraines or basal sliding say so plainly. ") * 3
QUESTIONS = ["Where do I start?", "What is a moraine?", "How fast do glaciers move?", "Why do crevasses form?"]


@pytest.fixture(scope="module")
def offline():
    return LLM("default", device="cpu", num_kv_blocks=1024)


@pytest.fixture(scope="module")
def prompts(offline) -> list[list[int]]:
    return [offline.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


HTTP_PORT = free_port()


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    dep = services.start(tmp_path_factory.mktemp("logs"), decode_role="both", num_decode=2, num_prefill=0,
                         metrics=True, extra_worker_args=["--tpot-target-ms", "500"],
                         router_args=["--pd-policy", "fleet", "--slo-tpot-ms", "500", "--http-port", str(HTTP_PORT),
                                      "--admission-slo-multiple", "0"])   # TIGHT requests are not refused
    yield dep
    dep.stop()


# A request objective no place keeps: TPOT 1 ms (a worker with decode rows has no room for it), TTFT
# 10 ms (no prefill estimate is under its 0.6 share): decoded where there are no rows, prefilled at
# the lowest TTFT estimate, the worker that holds its prefix.
TIGHT = router_pb2.RequestSlo(ttft_ms=10.0, tpot_ms=1.0)


def _request(tokens: list[int], max_tokens: int = MAX_TOKENS,
             slo: router_pb2.RequestSlo | None = None) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens), slo=slo,
                                      params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def _stream(dep, tokens: list[int], max_tokens: int = MAX_TOKENS, slo: router_pb2.RequestSlo | None = None
            ) -> list[int]:
    return [t for msg in dep.router_stub().Generate(_request(tokens, max_tokens, slo), timeout=180)
            for t in msg.token_ids]


def _decisions(dep, kind: str) -> float:
    total = 0.0
    for line in dep.scrape("router").splitlines():
        m = re.match(r'pdserve_router_pd_decisions_total\{(.*)\} (\S+)$', line)
        if m and f'kind="{kind}"' in m.group(1) and 'reason="fleet"' in m.group(1):
            total += float(m.group(2))
    return total


def _transfers(dep) -> int:
    return sum(dep.stats(w).num_kv_transfers for w in dep.decode)


def _whole(dep) -> None:
    for w in dep.decode:
        dep.wait_whole(w)


def _first_tokens(call, n: int) -> None:
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= n:
            return


def test_local_and_cross_worker_prefill_match_offline_and_pools_whole(deployment, offline, prompts):
    expected = [o.token_ids for o in offline.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                      use_tqdm=False)]
    # first: nothing cached anywhere, no decode rows: prefilled where it decodes
    assert _stream(deployment, prompts[0]) == expected[0]
    assert _decisions(deployment, "local") == 1 and _transfers(deployment) == 0
    # a long stream that shares the system prompt decodes where that prompt is cached (co-location's
    # pick: the cached prefix), prefilled there
    long_call = deployment.router_stub().Generate(_request(prompts[2], 400), timeout=180)
    _first_tokens(long_call, 2)
    assert _decisions(deployment, "local") == 2
    # while it runs, a TIGHT request with that system prompt: the other worker (no rows) decodes it,
    # the first (its prompt cached, the lowest TTFT estimate) prefills it and ships the KV over
    assert _stream(deployment, prompts[1], slo=TIGHT) == expected[1]
    long_call.cancel()
    assert _decisions(deployment, "remote") == 1
    sent = sum(deployment.stats(w).kv_transfer_bytes for w in deployment.decode)
    assert _transfers(deployment) == 2 and sent > 0          # a both worker counts a send and a receive
    _whole(deployment)


def _cancel_after_tokens(dep, tokens: list[int], n: int = 3, slo: router_pb2.RequestSlo | None = None) -> int:
    return dep.cancel_after_tokens(_request(tokens, 400, slo), n)


def test_cancel_in_each_path_leaves_both_pools_whole(deployment, offline, prompts):
    # a prompt nobody holds (local), then one whose system prompt only that worker holds (cross-worker)
    system = SYSTEM.replace("glacier physics", "harbour logistics")
    first, second = (offline.apply_chat_template([{"role": "system", "content": system},
                                                  {"role": "user", "content": q}]) for q in QUESTIONS[2:])
    paths = []
    for tokens in (first, second):
        local = _decisions(deployment, "local")
        # for the second: a stream on the worker that holds the system prompt, so the other decodes it
        busy = deployment.router_stub().Generate(_request(first, 400), timeout=180) if tokens is second else None
        if busy is not None:
            _first_tokens(busy, 2)
            local += 1
        assert _cancel_after_tokens(deployment, tokens, slo=TIGHT if busy is not None else None) >= 3
        paths.append("local" if _decisions(deployment, "local") > local else "remote")
        if busy is not None:
            busy.cancel()
        _whole(deployment)
    assert paths == ["local", "remote"]


def _chat(headers: dict[str, str]) -> tuple[int, dict]:
    body = {"messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{HTTP_PORT}/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_request_slos_are_served_and_bad_ones_refused(deployment, offline, prompts):
    expected = offline.generate(prompts[3:], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                use_tqdm=False)[0].token_ids
    req = _request(prompts[3])
    req.slo.CopyFrom(router_pb2.RequestSlo(ttft_ms=800.0, tpot_ms=300.0))    # tighter than the router's 500
    assert [t for m in deployment.router_stub().Generate(req, timeout=180) for t in m.token_ids] == expected
    req.slo.tpot_ms = -1.0
    with pytest.raises(grpc.RpcError) as e:
        list(deployment.router_stub().Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "slo.tpot_ms" in e.value.details()
    status, body = _chat({"x-slo-tpot-ms": "300", "x-slo-ttft-ms": "900"})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    status, body = _chat({"x-slo-tpot-ms": "soon"})
    assert status == 400 and body["error"]["param"] == "x-slo-tpot-ms", body
    _whole(deployment)
