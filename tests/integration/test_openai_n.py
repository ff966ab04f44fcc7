"""n > 1 as one request, and echo without generation, through the OpenAI HTTP API with the
official ``openai`` SDK (unmodified), on the embedded model (CPU).

- Disaggregated (``pdserve up``: router + prefill + decode): ``n=4`` with a seed gives four
  choices from one prefill (the prefill worker looks the prompt up once, the decode worker
  reserves it once: each worker's ``prefix_cache_query_tokens`` grows by the prompt's length, not
  four times it), each choice equal to an ``n=1`` request seeded ``seed + index``; both pools
  whole after.
- Co-located (one role-both worker): the same, the fork on that worker.
- gRPC ``Generate`` with ``params.n = 3``: every message names its sample (``index``), each
  sample has its own last message with a finish reason and usage (also when the prefill
  worker's first token ends sample 0: the decode worker's reservation still forks).
- Completions ``echo`` with ``max_tokens 0``: the prompt (and its logprobs) and no completion.
- Cancel and deadline of n=4 streams with both cores busy: every pool whole.
"""
from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from bench import deployment as services
from pdserve.v1 import common_pb2, router_pb2
from tests.integration.cpu_load import CpuLoad


@pytest.fixture(scope="module")
def disagg(openai_up):
    """The session's ``pdserve up`` (tests/integration/conftest.py)."""
    return openai_up


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    d = services.start_up(tmp_path_factory.mktemp("n-both"), [
        "--prefill", "0", "--decode", "1", "--role", "both", "--extra-router-args=--admission-slo-multiple 0"],
        num_prefill=0, num_decode=1, decode_role="both")
    yield d
    d.stop()


def _client(dep) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.http, api_key="unused", max_retries=0, timeout=120)


def _queries(dep) -> list[int]:
    return [dep.stats(a).prefix_cache_query_tokens for a in (*dep.prefill, *dep.decode)]


def _whole(dep) -> None:
    for a in (*dep.prefill, *dep.decode):
        dep.wait_whole(a)


def _prompt() -> str:
    return (f"Request {uuid.uuid4().hex}. Write one short sentence about the sea, the wind and the old "
            "lighthouse on the hill.")     # a prompt no earlier request cached


@pytest.mark.parametrize("layout", ["disagg", "both"])
def test_n4_with_a_seed_is_one_prefill_and_equals_seeded_requests(request, layout):
    dep = request.getfixturevalue(layout)
    client = _client(dep)
    model = client.models.list().data[0].id
    prompt = _prompt()
    before = _queries(dep)
    r = client.completions.create(model=model, prompt=prompt, n=4, seed=7, temperature=1.0, max_tokens=12)
    after = _queries(dep)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompt_tokens = r.usage.prompt_tokens // 4             # counted once per choice
    assert [b - a for a, b in zip(before, after)] == [prompt_tokens] * len(before)   # one lookup per worker
    texts = [c.text for c in r.choices]
    assert len(set(texts)) > 1                                               # four samples, not one
    for i, text in enumerate(texts):
        one = client.completions.create(model=model, prompt=prompt, seed=7 + i, temperature=1.0, max_tokens=12)
        assert one.choices[0].text == text, i
    _whole(dep)


@pytest.mark.parametrize("max_tokens", [6, 1])     # 1: sample 0 ends with the prefill worker's token
def test_grpc_stream_names_each_sample(disagg, max_tokens):
    params = common_pb2.SamplingParams(temperature=1.0, seed=3, max_tokens=max_tokens, ignore_eos=True, n=3)
    msgs = list(disagg.router_stub().Generate(router_pb2.GenerateRequest(text=_prompt(), params=params), timeout=120))
    by_index: dict[int, list] = {}
    for m in msgs:
        by_index.setdefault(m.index, []).append(m)
    assert sorted(by_index) == [0, 1, 2]
    for ms in by_index.values():
        assert sum(len(m.token_ids) for m in ms) == max_tokens
        assert [m.finish_reason for m in ms].count(common_pb2.FINISH_REASON_LENGTH) == 1
        assert ms[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert ms[-1].usage.completion_tokens == max_tokens
    _whole(disagg)


def test_echo_with_max_tokens_0_returns_the_prompt_only(disagg):
    client = _client(disagg)
    model = client.models.list().data[0].id
    prompt = "The capital of France is Paris. The capital of Italy is"
    r = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, logprobs=1)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(c.logprobs.tokens)
    assert "".join(c.logprobs.tokens) == prompt
    assert c.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in c.logprobs.token_logprobs[1:])
    plain = client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0)
    assert plain.choices[0].text == prompt and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):       # without echo, 0 is still refused
        client.completions.create(model=model, prompt=prompt, max_tokens=0)
    streamed = list(client.completions.create(model=model, prompt=prompt, echo=True, max_tokens=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == prompt
    _whole(disagg)


@pytest.mark.parametrize("layout", ["disagg", "both"])
def test_cancel_and_deadline_of_n4_requests_with_the_cpu_loaded_leave_every_pool_whole(request, layout):
    """n=4 streams cancelled by their clients after a few tokens (some samples forked, some
    still prefilling), and one that runs into its deadline, with both cores busy: every pool whole."""
    dep = request.getfixturevalue(layout)
    params = common_pb2.SamplingParams(temperature=1.0, seed=5, max_tokens=400, ignore_eos=True, n=4)
    load = CpuLoad(60.0)
    try:
        with ThreadPoolExecutor(3) as pool:
            seen = list(pool.map(lambda _: dep.cancel_after_tokens(
                router_pb2.GenerateRequest(text=_prompt(), params=params), 3), range(3)))
        with pytest.raises(grpc.RpcError) as err:
            list(dep.router_stub().Generate(router_pb2.GenerateRequest(text=_prompt(), params=params), timeout=2.0))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        load.stop()
    assert all(n >= 3 for n in seen)
    _whole(dep)
