"""Tool calls of the OpenAI API without a server: output parsing (named, required, Hermes and
Llama 3 formats), streamed deltas in the shape the SDK assembles, and chat rendering with and
without a template that knows tools."""
from __future__ import annotations

import json

from pdserve.router.openai_api.tool_stream import ToolStream
from pdserve.router.openai_api.tools import ToolRequest, parse_auto, parse_output, render

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_named_and_required_outputs():
    named = ToolRequest((TOOL,), "named", "get_weather")
    content, calls = parse_output(named, ' {"city": "Paris"}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    required = ToolRequest((TOOL,), "required")
    _, calls = parse_output(required, '{"name": "get_weather", "arguments": {"city": "Rome"}}')
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert parse_output(required, "not json") == ("not json", [])


def test_auto_parses_hermes_blocks_and_bare_llama3_calls():
    content, calls = parse_auto('Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
                                '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert content == "Let me check." and [c.name for c in calls] == ["a", "b"]
    assert len({c.id for c in calls}) == 2
    content, calls = parse_auto('{"name": "a", "parameters": {"x": 2}}')
    assert content is None and json.loads(calls[0].arguments) == {"x": 2}
    assert parse_auto("Just text.") == ("Just text.", [])


def test_named_stream_sends_the_header_then_argument_fragments():
    s = ToolStream(ToolRequest((TOOL,), "named", "get_weather"))
    first = s.deltas('{"ci', False)
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert first[0]["tool_calls"][0]["index"] == 0 and first[0]["tool_calls"][0]["id"].startswith("call_")
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}
    assert s.deltas('ty": "Paris"}', True) == [{"tool_calls": [{"index": 0, "function": {"arguments":
                                                                                         'ty": "Paris"}'}}]}]
    assert s.finish_reason_override is None


def test_auto_stream_sends_content_until_the_marker_then_the_calls():
    s = ToolStream(ToolRequest((TOOL,), "auto"))
    assert s.deltas("Sure. <tool", False) == [{"content": "Sure. "}]     # a possible marker is held back
    assert s.deltas('_call>{"name": "get_weather", ', False) == []
    out = s.deltas('"arguments": {"city": "Oslo"}}</tool_call>', True)
    assert out[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert s.finish_reason_override == "tool_calls"
    plain = ToolStream(ToolRequest((TOOL,), "auto"))
    assert plain.deltas("a <to", False) == [{"content": "a "}]
    assert plain.deltas("day", True) == [{"content": "<today"}]
    assert plain.finish_reason_override is None


class _Tok:
    def __init__(self, template: str) -> None:
        self.chat_template = template
        self.seen: dict = {}

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        self.seen = {"messages": messages, "tools": tools}
        return "rendered"


def test_render_gives_tools_to_a_template_that_knows_them_else_text():
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": '{"c": 1}'}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "1"}]
    req = ToolRequest((TOOL,), "auto")
    native = _Tok("{% if tools %}...{% endif %}")
    render(native, history, req, True)
    assert native.seen["tools"] == [TOOL]
    assert native.seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"c": 1}
    plain = _Tok("{{ messages }}")
    render(plain, history, req, True)
    msgs = plain.seen["messages"]
    assert plain.seen["tools"] is None and msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert "<tool_call>" in msgs[2]["content"]
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
