"""Structured outputs, tool calls and n > 1 through the OpenAI HTTP API, driven by the official
``openai`` SDK (unmodified) against ``pdserve up`` (router + prefill + decode processes, the
embedded model, CPU): the guide crosses the KV handoff (the prefill worker's first token obeys
it, the decode worker continues it).

- ``chat.completions.parse(response_format=<a Pydantic model>)`` returns a valid object for
  every one of 20 prompts (sampled, seeded);
- a streamed tool call (named and required tool_choice) assembled by the SDK's stream helper has
  a name and arguments that parse and match the tool's schema;
- ``n=4`` with a seed: four samples, reproducible, from one prefill (each worker looks the prompt
  up once; the fork itself: tests/integration/test_openai_n.py);
- cancelling an n=4 or a guided stream mid-way leaves both block pools whole, and so does a
  deadline passing mid-way (gRPC: four streams of one prompt, or one guided stream).
"""
from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import grpc
import openai
import pytest
from pydantic import BaseModel, Field

from pdserve.v1 import common_pb2, router_pb2

BLOCK = 16        # pdserve up's block size


class Verdict(BaseModel):
    capital: Literal["Paris", "London", "Rome", "Berlin", "Madrid"]
    confident: bool
    note: str = Field(max_length=24)


class GetWeather(BaseModel):
    """Look up the weather of a city."""
    city: Literal["Paris", "London", "Tokyo"]
    unit: Literal["celsius", "fahrenheit"]


class GetTime(BaseModel):
    """The local time of a city."""
    city: str = Field(max_length=12)


COUNTRIES = ["France", "England", "Italy", "Germany", "Spain"]


@pytest.fixture(scope="module")
def dep(openai_up):
    return openai_up            # tests/integration/conftest.py


@pytest.fixture(scope="module")
def client(dep) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.http, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _whole(dep) -> None:
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])


def test_parse_with_a_pydantic_model_gives_a_valid_object_for_20_prompts(dep, client, model):
    def parse(i: int):
        country = COUNTRIES[i % len(COUNTRIES)]
        return client.chat.completions.parse(
            model=model, response_format=Verdict, temperature=0.8, seed=i, max_tokens=80,
            messages=[{"role": "user", "content": f"What is the capital of {country}? Answer in JSON."}])
    with ThreadPoolExecutor(20) as pool:          # at once: the engine batches the guided rows
        responses = list(pool.map(parse, range(20)))
    for r in responses:
        parsed = r.choices[0].message.parsed
        assert isinstance(parsed, Verdict), r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    _whole(dep)


def test_json_object_regex_and_choice(client, model):
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Give me JSON."}],
                                       response_format={"type": "json_object"}, temperature=0, max_tokens=120)
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    c = client.completions.create(model=model, prompt="My zip code is", max_tokens=12, temperature=0.9, seed=1,
                                  extra_body={"guided_regex": "[0-9]{5}"})
    assert re.fullmatch("[0-9]{5}", c.choices[0].text), c.choices[0].text
    c = client.completions.create(model=model, prompt="The sky is", max_tokens=12, temperature=0,
                                  extra_body={"guided_choice": ["blue", "green"]})
    assert c.choices[0].text in ("blue", "green")


def test_a_schema_that_does_not_compile_is_a_400_naming_the_field(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "properties": {"a": 5}}}})
    assert e.value.param == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model, prompt="hi", max_tokens=4, extra_body={"guided_regex": "(a"})
    assert e.value.param == "guided_regex"


@pytest.mark.parametrize("tool_choice", ["named", "required"])
def test_streamed_tool_call_is_assembled_by_the_sdk(dep, client, model, tool_choice):
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    choice = {"type": "function", "function": {"name": "GetWeather"}} if tool_choice == "named" else "required"
    with client.chat.completions.stream(
            model=model, messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
            tools=tools, tool_choice=choice, temperature=0, max_tokens=60) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls and len(calls) == 1, final
    call = calls[0]
    assert call.id and call.type == "function"
    assert final.choices[0].finish_reason == ("stop" if tool_choice == "named" else "tool_calls")
    args = json.loads(call.function.arguments)
    if call.function.name == "GetWeather":
        GetWeather.model_validate(args)
        assert isinstance(call.function.parsed_arguments, GetWeather)
    else:
        assert tool_choice == "required" and call.function.name == "GetTime"
        GetTime.model_validate(args)
    whole = client.chat.completions.create(    # the same call in one answer
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        tools=tools, tool_choice=choice, temperature=0, max_tokens=60)
    assert whole.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    _whole(dep)


def test_tool_turns_in_the_history_are_rendered(client, model):
    """An assistant tool call and its result in the messages (an agent's second turn)."""
    tools = [openai.pydantic_function_tool(GetWeather)]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "GetWeather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                       temperature=0, max_tokens=16)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def _queries(dep) -> int:
    return sum(dep.stats(a).prefix_cache_query_tokens for a in (*dep.prefill, *dep.decode))


def test_n4_with_a_seed_is_one_prefill_and_reproducible(dep, client, model):
    nonce = uuid.uuid4().hex      # a prompt no earlier test cached
    content = f"Request {nonce}. Write one short sentence about the sea, the wind and the old lighthouse."
    before = _queries(dep)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], n=4,
                                       seed=7, temperature=1.0, max_tokens=12)
    after = _queries(dep)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompt_tokens = r.usage.prompt_tokens // 4            # counted once per choice
    assert after - before == 2 * prompt_tokens             # one lookup on each of the two workers
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1                                   # four samples, not one
    again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], n=4,
                                           seed=7, temperature=1.0, max_tokens=12)
    assert [c.message.content for c in again.choices] == texts
    _whole(dep)


@pytest.mark.parametrize("extra", [{"n": 4}, {"response_format": {"type": "json_object"}}])
def test_cancel_mid_stream_of_n4_or_guided_frees_both_pools(dep, client, model, extra):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story in JSON."}], max_tokens=300,
        temperature=1.0, stream=True, **extra)
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 4:
            break
    stream.close()
    _whole(dep)


def _until_deadline(stub, request: router_pb2.GenerateRequest, timeout: float) -> tuple[int, grpc.StatusCode]:
    """Stream ``request`` with a deadline; (tokens seen, the status it ended with)."""
    got = 0
    try:
        for msg in stub.Generate(request, timeout=timeout):
            got += len(msg.token_ids)
    except grpc.RpcError as e:
        return got, e.code()
    return got, grpc.StatusCode.OK


@pytest.mark.parametrize("guided", [False, True])
def test_deadline_mid_stream_of_four_samples_or_guided_frees_both_pools(dep, guided):
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=2000, ignore_eos=not guided, seed=5)
    if guided:              # a JSON array that cannot be complete before the deadline
        params.guide.json_schema = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 5000})
    n = 1 if guided else 4
    requests = [router_pb2.GenerateRequest(text=f"Tell me a long story {uuid.uuid4().hex}.", params=params)] * n
    stub = dep.router_stub()
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda r: _until_deadline(stub, r, 4.0), requests))
    assert all(code == grpc.StatusCode.DEADLINE_EXCEEDED for _, code in results), results
    assert any(got > 0 for got, _ in results), results          # it passed mid-stream
    _whole(dep)
