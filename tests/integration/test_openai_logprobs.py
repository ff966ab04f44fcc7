"""Log-probabilities, echo, logit_bias and min_tokens through the OpenAI HTTP API, driven by the
official ``openai`` SDK (unmodified) against ``pdserve up`` on the embedded model (CPU),
disaggregated (router + prefill + decode: prompt logprobs travel with the first token) and
co-located (one worker of role both).

- chat ``top_logprobs``: per token, that many alternatives, most likely first, the greedy token
  first with its own logprob; streamed and unary agree;
- completions ``echo`` + ``logprobs`` (what lm-eval's loglikelihood sends): the prompt's tokens
  come first (the first without a logprob), and each prompt position's top logprobs equal those
  of a generation from the prompt cut there (the same logits, another path through the server);
  a prompt already in the prefix cache is scored whole; both deployments give the same values;
- ``logit_bias`` of +100 forces a token; ``min_tokens`` holds off a stop token id;
- ``best_of`` 3 with ``n`` 1 answers, of the three seeded samples ``n`` 3 gives, the one with the
  highest cumulative logprob (usage counts all three);
- the gRPC API carries the same values (GenerateUnary: top and prompt logprobs);
- both block pools are whole afterwards.
"""
from __future__ import annotations

import math
import uuid

import openai
import pytest

from bench import deployment as services
from pdserve.v1 import common_pb2, router_pb2

K = 3


@pytest.fixture(scope="module", params=["disagg", "colocated"])
def dep(request, tmp_path_factory):
    if request.param == "disagg":
        yield request.getfixturevalue("openai_up")       # tests/integration/conftest.py
        return
    d = services.start_up(tmp_path_factory.mktemp("logprobs-colocated"), ["--prefill", "0", "--role", "both"])
    d.colocated = True
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(dep) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.http, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pdserve.common.default_model import ensure_default_model
    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


def _whole(dep) -> None:
    dep.wait_whole(dep.decode[0])
    if not dep.colocated:
        dep.wait_whole(dep.prefill[0])


def test_chat_top_logprobs_unary_and_streamed(dep, client, model):
    messages = [{"role": "user", "content": "Name three colours."}]
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=K)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for item in content:
        tops = item.top_logprobs
        assert len(tops) == K
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == item.token and math.isclose(tops[0].logprob, item.logprob, abs_tol=1e-6)
        assert bytes(item.bytes).decode(errors="replace") is not None
    streamed = []
    for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                                logprobs=True, top_logprobs=K, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(c.token, [t.token for t in c.top_logprobs]) for c in streamed] == \
        [(c.token, [t.token for t in c.top_logprobs]) for c in content]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-5) for a, b in zip(streamed, content))
    _whole(dep)


def _echo(client, model, ids: list[int], k: int = K, **kw):
    return client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=1, logprobs=k,
                                     echo=True, **kw)


def test_echo_prompt_logprobs_equal_those_of_generations_from_the_cut_prompt(dep, client, model, tokenizer):
    text = f"Request {uuid.uuid4().hex[:8]}: the quick brown fox jumps over the lazy dog near the river bank."
    ids = tokenizer(text)["input_ids"]
    r = _echo(client, model, ids)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith(text) and lp.text_offset[0] == 0
    assert r.usage.completion_tokens == 1 and r.usage.prompt_tokens == n
    for p in (1, n // 2, n - 1):          # position p scores prompt token p from ids[:p]
        cut = client.completions.create(model=model, prompt=ids[:p], temperature=0, max_tokens=1, logprobs=K)
        want = cut.choices[0].logprobs.top_logprobs[0]
        got = lp.top_logprobs[p]
        assert set(want) <= set(got) and all(math.isclose(got[t], v, abs_tol=1e-4) for t, v in want.items())
        assert lp.token_logprobs[p] <= max(got.values()) + 1e-6
        if lp.tokens[p] in want:
            assert math.isclose(lp.token_logprobs[p], want[lp.tokens[p]], abs_tol=1e-4)
    again = _echo(client, model, ids)          # its blocks are cached now: scored whole again
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].logprobs.token_logprobs == lp.token_logprobs
    streamed = list(_echo(client, model, ids, stream=True))
    first = next(c for c in streamed if c.choices)
    assert first.choices[0].text.startswith(text)
    assert first.choices[0].logprobs.token_logprobs[:n] == lp.token_logprobs[:n]
    _whole(dep)


def test_echo_without_logprobs_and_many_prompts(dep, client, model):
    r = client.completions.create(model=model, prompt=["One two", "Three four"], max_tokens=2, temperature=0,
                                  echo=True)
    texts = sorted(r.choices, key=lambda c: c.index)
    assert texts[0].text.startswith("One two") and texts[1].text.startswith("Three four")
    assert texts[0].logprobs is None
    _whole(dep)


def test_logit_bias_forces_a_token_and_min_tokens_holds_off_a_stop(dep, client, model, tokenizer):
    forced = tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    r = client.completions.create(model=model, prompt="My favourite fruit is", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == tokenizer.decode([forced] * 4)
    plain = client.completions.create(model=model, prompt="Count: one, two,", max_tokens=1, temperature=0,
                                      logprobs=0)
    first = tokenizer(plain.choices[0].logprobs.tokens[0], add_special_tokens=False)["input_ids"][0]
    stopped = client.completions.create(model=model, prompt="Count: one, two,", max_tokens=6, temperature=0,
                                        extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].finish_reason == "stop"
    held = client.completions.create(model=model, prompt="Count: one, two,", max_tokens=6, temperature=0,
                                     extra_body={"stop_token_ids": [first], "min_tokens": 3})
    assert held.usage.completion_tokens >= 3
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="x", max_tokens=2, logit_bias={"99999999": 1})
    assert e.value.param == "logit_bias"
    _whole(dep)


def test_best_of_answers_the_likeliest_of_the_samples(dep, client, model):
    kw = dict(model=model, prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    samples = client.completions.create(n=3, logprobs=0, **kw).choices
    best = max(sorted(samples, key=lambda c: c.index), key=lambda c: sum(c.logprobs.token_logprobs))
    r = client.completions.create(n=1, best_of=3, **kw)
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    assert r.choices[0].text == best.text
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in samples)
    _whole(dep)


def test_grpc_carries_top_and_prompt_logprobs(dep, client, model, tokenizer):
    ids = tokenizer("The river runs to the sea and the sea is never full.")["input_ids"]
    params = common_pb2.SamplingParams(max_tokens=3, logprobs=True, top_logprobs=2, prompt_logprobs=True)
    res = dep.router_stub().GenerateUnary(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                                     params=params), timeout=120)
    assert len(res.logprobs) == len(res.top_logprobs) == len(res.token_ids) == 3
    assert [list(t.token_ids)[0] for t in res.top_logprobs] == list(res.token_ids)     # greedy
    assert len(res.prompt_logprobs) == len(res.prompt_top_logprobs) == len(ids) - 1
    http = _echo(client, model, ids, k=2).choices[0].logprobs
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(res.prompt_logprobs, http.token_logprobs[1:len(ids)]))
    _whole(dep)
