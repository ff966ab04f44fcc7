"""Tool calls on the chat API: ``tools`` and ``tool_choice`` -> a prompt and a guide; the output
-> OpenAI ``tool_calls``.

- ``tool_choice`` ``"none"``: the tools are shown to the model, the output is text.
- ``"auto"`` (the default with tools): free output; Hermes-style ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>`` blocks in it (Qwen2.5/Qwen3's format; Llama 3's bare JSON
  ``{"name": ..., "parameters": ...}`` too) become tool calls, the text around them content.
- ``"required"``: the output is constrained (guided decoding) to one JSON object
  ``{"name": <a tool's name>, "arguments": <that tool's parameters schema>}``.
- ``{"type": "function", "function": {"name": N}}``: the output is constrained to tool N's
  ``parameters`` schema: the whole output is the call's arguments (as vLLM's named choice).

The chat is rendered here (not by the request path's chat input, which has no place for tools):
a template that knows tools (``tools`` in its source) gets them and the messages as sent
(assistant ``tool_calls``, ``tool`` messages); any other template gets them as text: a system
message listing the tools and the Hermes format, assistant calls as ``<tool_call>`` blocks and
tool results as ``<tool_response>`` blocks in a user turn.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pdserve.router.openai_api.errors import bad_request
from pdserve.router.openai_api.structured import GuideRequest
from pdserve.v1 import common_pb2

CHOICES = ("none", "auto", "required")
_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
TOOL_PROMPT = ("You may call one of these functions. To call one, answer with\n<tool_call>\n"
               '{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>\n'
               "Functions:\n")


@dataclass(frozen=True)
class ToolRequest:
    """The body's tools (as sent, each checked) and its choice: none, auto, required or named."""

    tools: tuple[dict, ...]
    choice: str
    named: str | None = None

    def parameters(self, name: str) -> dict:
        for t in self.tools:
            if t["function"]["name"] == name:
                return t["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    @property
    def constrained(self) -> bool:
        return self.choice in ("required", "named")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str          # JSON text
    id: str = ""

    def to_json(self, index: int | None = None) -> dict:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools, or None when it has none; a 400 naming the field when malformed."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "must be a list of tools")
    names = [_check_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    if choice is None or choice in CHOICES:
        return ToolRequest(tuple(tools), choice or "auto")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise bad_request("tool_choice", 'must be "none", "auto", "required" or {"type": "function", '
                                         '"function": {"name": ...}}')
    if name not in names:
        raise bad_request("tool_choice.function.name", f"{name!r} is not one of the tools ({', '.join(names)})")
    return ToolRequest(tuple(tools), "named", name)


def _check_tool(tool: object, where: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(where, 'must be {"type": "function", "function": {...}}')
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function.name", "must be a non-empty string")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_request(f"{where}.function.parameters", "must be a JSON Schema object")
    return fn["name"]


def tool_guide(req: ToolRequest) -> GuideRequest | None:
    """The guide of a constrained choice (named: the tool's parameters; required: a call object
    of any tool); None for none / auto."""
    if req.choice == "named":
        assert req.named is not None
        schema: dict = req.parameters(req.named)
    elif req.choice == "required":
        schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": t["function"]["name"]},
                                            "arguments": req.parameters(t["function"]["name"])}}
                            for t in req.tools]}
    else:
        return None
    return GuideRequest(common_pb2.Guide(json_schema=json.dumps(schema)), "tools")


def parse_output(req: ToolRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a finished output."""
    if req.choice == "named":
        assert req.named is not None
        return None, [ToolCall(req.named, text.strip(), new_call_id())]
    if req.choice == "required":
        call = _call_from_json(text)
        return (None, [call]) if call is not None else (text, [])
    if req.choice == "none":
        return text, []
    return parse_auto(text)


def parse_auto(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes ``<tool_call>`` blocks, or one bare JSON call (Llama 3), out of free text."""
    calls = [c for c in (_call_from_json(m.group(1)) for m in _CALL_BLOCK.finditer(text)) if c is not None]
    if calls:
        content = _CALL_BLOCK.sub("", text).strip()
        return content or None, calls
    bare = _call_from_json(text)
    return (None, [bare]) if bare is not None else (text, [])


def _call_from_json(text: str) -> ToolCall | None:
    try:
        obj = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    args_text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(obj["name"], args_text, new_call_id())


def render(tokenizer: Any, messages: list[dict], req: ToolRequest | None, add_generation_prompt: bool) -> str:
    """The chat rendered with the model's template, tools included (see the module docstring)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if req is not None and "tools" in template:
        return tokenizer.apply_chat_template(_native(messages), tools=list(req.tools), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    msgs = [_as_text(m) for m in messages]
    if req is not None:
        listing = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in req.tools)
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + TOOL_PROMPT + listing}
        else:
            msgs.insert(0, {"role": "system", "content": TOOL_PROMPT + listing})
    return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)


def _native(messages: list[dict]) -> list[dict]:
    """Messages for a template that knows tools: tool-call arguments as objects (HF's form)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        m["content"] = m.get("content") or ""
        out.append(m)
    return out


def _as_text(m: dict) -> dict:
    """One message for a template without tools: calls and results as Hermes text blocks."""
    content = m.get("content") or ""
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": _loads(c["function"]["arguments"])},
                         ensure_ascii=False) for c in m.get("tool_calls") or []]
    text = "\n".join([content] * bool(content) + [f"<tool_call>\n{b}\n</tool_call>" for b in blocks])
    return {"role": m["role"], "content": text}


def _loads(arguments: object) -> object:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments
