"""OpenAI request bodies -> GenerateRequest messages, and failures -> OpenAI's error shape
(pdserve.router.openai_api; pure functions, no server: the served API is in
tests/integration/test_openai_api.py)."""
from __future__ import annotations

import json

import pytest

from pdserve.common.grpc_utils import InvalidArgument, ResourceExhausted, Unavailable
from pdserve.router.openai_api.errors import ApiError, from_exception, openai_param
from pdserve.router.openai_api.requests import CHAT, COMPLETION, parse_chat, parse_completion


def test_chat_body_becomes_one_chat_request_with_openai_defaults():
    api = parse_chat({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                              {"type": "text", "text": "b"}]}],
                      "max_completion_tokens": 7, "stop": "END", "seed": 3, "stream": True,
                      "stream_options": {"include_usage": True}, "ignore_eos": True})
    (req,) = api.inputs
    assert api.kind == CHAT and api.id.startswith("chatcmpl-") and req.request_id == api.id
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "Be brief."), ("user", "a\nb")]
    p = req.params
    assert (p.temperature, p.max_tokens, list(p.stop), p.seed, p.ignore_eos) == (1.0, 7, ["END"], 3, True)
    assert api.stream and api.include_usage and not api.continuous_usage
    assert api.max_tokens_field == "max_completion_tokens" and not req.skip_generation_prompt


def test_completion_prompts_text_ids_and_batches():
    assert parse_completion({"prompt": "hi"}).inputs[0].params.max_tokens == 16       # OpenAI's default
    ids = parse_completion({"prompt": [1, 2, 3], "max_tokens": 4})
    assert list(ids.inputs[0].token_ids.ids) == [1, 2, 3] and ids.input_fields == ("prompt",)
    batch = parse_completion({"prompt": ["a", [5, 6]], "logprobs": 0})
    assert [r.WhichOneof("input") for r in batch.inputs] == ["text", "token_ids"]
    assert batch.input_fields == ("prompt[0]", "prompt[1]") and batch.logprobs and batch.kind == COMPLETION
    assert len({r.request_id for r in batch.inputs}) == 2


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": ["a"] * 40, "n": 2}, "n"),
    ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    ({"prompt": ["a"] * 20, "n": 2, "best_of": 4}, "best_of"),
    ({"prompt": "x", "response_format": {"type": "yaml"}}, "response_format.type"),
    ({"prompt": "x", "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format.json_schema.schema"),
    ({"prompt": "x", "guided_json": 3}, "guided_json"),
    ({"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "temperature": True}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "high"}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", 1.5]}, "prompt[1]"),
    ({"prompt": [[1, -2]]}, "prompt[0][1]"),
])
def test_bad_completion_bodies_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param


TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {}}]},
     "tools[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "maybe"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tools"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0]"),
])
def test_bad_chat_bodies_name_the_field(body, param):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.status == 400 and e.value.param == param


def test_request_path_errors_get_openai_names_and_statuses():
    assert openai_param("params.top_p") == "top_p"
    assert openai_param("params.max_tokens", max_tokens_field="max_completion_tokens") == "max_completion_tokens"
    assert openai_param("chat.messages[2].role") == "messages[2].role"
    assert openai_param("token_ids.ids[7]", prompt_field="prompt[1]") == "prompt[1][7]"
    assert openai_param("text") == "prompt" and openai_param("chat") == "messages"
    bad = from_exception(InvalidArgument("params.presence_penalty", "must be in [-2, 2], got 3.0"))
    assert (bad.status, bad.param, bad.message) == \
        (400, "presence_penalty", "presence_penalty: must be in [-2, 2], got 3.0")
    busy, down = from_exception(ResourceExhausted("no room")), from_exception(Unavailable("no decode worker is up"))
    assert (busy.status, busy.type, busy.headers()) == (429, "rate_limit_error", {"retry-after": "1"})
    assert (down.status, down.code) == (503, "unavailable")
    assert down.body() == {"error": {"message": "no decode worker is up", "type": "service_unavailable",
                                     "param": None, "code": "unavailable"}}


def test_n_is_one_request_of_n_samples_per_prompt():
    api = parse_completion({"prompt": ["a", "b"], "n": 3, "seed": 7})
    assert api.n == 3 and len(api.inputs) == 6 and api.input_fields == ("prompt[0]",) * 3 + ("prompt[1]",) * 3
    assert [r.params.seed for r in api.inputs] == [7] * 6          # the workers seed sample i with 7 + i
    assert [r.params.n for r in api.inputs] == [3] * 6
    assert [r.text for r in api.inputs] == ["a"] * 3 + ["b"] * 3
    assert len({r.request_id for r in api.inputs}) == 2 and len({id(r) for r in api.inputs}) == 2
    unseeded = parse_chat({"messages": [{"role": "user", "content": "hi"}], "n": 2})
    assert not any(r.params.HasField("seed") for r in unseeded.inputs) and len(unseeded.inputs) == 2
    assert parse_chat({"messages": [{"role": "user", "content": "hi"}]}).inputs[0].params.n == 0   # one


def test_structured_outputs_become_a_guide():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    api = parse_chat({"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}})
    assert json.loads(api.inputs[0].params.guide.json_schema) == schema
    assert api.guide_param == "response_format.json_schema.schema"
    json_object = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}})
    assert json_object.inputs[0].params.guide.json_object
    assert not parse_completion({"prompt": "x", "response_format": {"type": "text"}}).inputs[0].params.HasField("guide")
    assert parse_completion({"prompt": "x", "guided_regex": "[0-9]+"}).inputs[0].params.guide.regex == "[0-9]+"
    assert list(parse_completion({"prompt": "x", "guided_choice": ["y", "n"]}).inputs[0].params.guide.choice.choices) \
        == ["y", "n"]


def test_tool_choices_become_guides_and_a_rendered_chat():
    msgs = [{"role": "user", "content": "weather?"}]
    named = parse_chat({"messages": msgs, "tools": [TOOL],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert json.loads(named.inputs[0].params.guide.json_schema) == TOOL["function"]["parameters"]
    assert named.tools.choice == "named" and named.chat_messages == tuple(msgs)
    assert named.inputs[0].WhichOneof("input") is None           # the front renders it
    required = parse_chat({"messages": msgs, "tools": [TOOL], "tool_choice": "required"})
    branch = json.loads(required.inputs[0].params.guide.json_schema)["anyOf"][0]
    assert branch["properties"]["name"] == {"const": "get_weather"}
    auto = parse_chat({"messages": msgs, "tools": [TOOL]})
    assert auto.tools.choice == "auto" and not auto.inputs[0].params.HasField("guide")


def test_logprobs_echo_logit_bias_and_min_tokens_reach_the_params():
    api = parse_completion({"prompt": "x", "logprobs": 3, "echo": True, "logit_bias": {"17": -100, "4": 2.5},
                            "min_tokens": 2})
    p = api.inputs[0].params
    assert (api.echo, api.top_logprobs, p.logprobs, p.top_logprobs, p.prompt_logprobs) == (True, 3, True, 3, True)
    assert dict(p.logit_bias) == {17: -100.0, 4: 2.5} and p.min_tokens == 2
    plain = parse_completion({"prompt": "x", "echo": True}).inputs[0].params
    assert not plain.logprobs and not plain.prompt_logprobs          # echo alone: text only
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4})
    assert chat.top_logprobs == 4 and chat.inputs[0].params.top_logprobs == 4
    assert not chat.inputs[0].params.prompt_logprobs


def test_best_of_fans_out_best_of_samples_with_logprobs_and_keeps_n():
    api = parse_completion({"prompt": ["a", "b"], "n": 2, "best_of": 3, "seed": 4})
    assert (api.n, api.keep, len(api.inputs)) == (3, 2, 6)
    assert all(r.params.logprobs for r in api.inputs) and not api.logprobs    # for the ranking only
    assert [r.params.seed for r in api.inputs] == [4] * 6 and [r.params.n for r in api.inputs] == [3] * 6
    assert parse_completion({"prompt": "a", "n": 2, "best_of": 2}).keep == 0


def test_best_of_keeps_the_highest_cumulative_logprobs_per_prompt():
    from pdserve.router.openai_api.responses import Choice, best_of
    sums = [[-3.0, -1.0], [-0.5], [-2.0, -2.0], [-9.0], [-1.0], [-0.1, -0.1]]
    choices = [Choice(i, 1, logprobs=lps) for i, lps in enumerate(sums)]
    assert best_of(choices, 3, 2) == [1, 0, 5, 4]
