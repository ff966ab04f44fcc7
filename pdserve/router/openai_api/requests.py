"""OpenAI request bodies -> ``pdserve.v1.GenerateRequest`` messages for the request path.

Only the JSON is checked here (types, and 0 for ``max_tokens``, ``top_p``, ``repetition_penalty``);
ranges, the prompt and the context are checked once by
:meth:`pdserve.router.servicer.GenerationServicer.job`. Unsupported fields (n > 1, best_of > 1,
echo, suffix, logit_bias, tools, non-text response_format, top_logprobs) are refused with a 400
naming the field; unknown ones are ignored.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass

from pdserve.router.openai_api import fields
from pdserve.router.openai_api.errors import bad_request
from pdserve.v1 import common_pb2, router_pb2

MAX_PROMPTS = 64
CHAT, COMPLETION = "chat.completion", "text_completion"
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class ApiRequest:
    """One validated OpenAI request: one GenerateRequest per choice."""

    kind: str                                   # CHAT or COMPLETION (the response's "object")
    id: str                                     # chatcmpl-... / cmpl-...
    model: str | None
    inputs: tuple[router_pb2.GenerateRequest, ...]
    stream: bool = False
    include_usage: bool = False                 # stream_options.include_usage
    continuous_usage: bool = False              # stream_options.continuous_usage_stats (vLLM)
    logprobs: bool = False
    max_tokens_field: str = "max_tokens"
    input_fields: tuple[str, ...] = ("prompt",)   # the body's name of each input (errors)


def parse_chat(body: dict) -> ApiRequest:
    params, max_field = _sampling(body, None)
    logprobs = fields.boolean(body, "logprobs", False)
    if fields.integer(body, "top_logprobs", 0, 0, 20):
        raise bad_request("top_logprobs", "the engine reports only the chosen token's log-probability: "
                                          "top_logprobs must be 0 (use logprobs: true)")
    fields.only(body, "tools", ([],), "tools are not supported")
    fields.only(body, "tool_choice", ("none", "auto"), "tools are not supported")
    params.logprobs = logprobs
    req = _base_request(body, params)
    req.chat.CopyFrom(_messages(body))
    req.skip_generation_prompt = not fields.boolean(body, "add_generation_prompt", True)
    api_id = f"chatcmpl-{uuid.uuid4().hex}"
    req.request_id = api_id
    return _finish(body, CHAT, api_id, (req,), logprobs, max_field, ("messages",))


def parse_completion(body: dict) -> ApiRequest:
    params, max_field = _sampling(body, COMPLETION_DEFAULT_MAX_TOKENS)
    n_logprobs = fields.integer(body, "logprobs", None, 0, 20)
    if n_logprobs:
        raise bad_request("logprobs", "the engine reports only the chosen token's log-probability: "
                                      "logprobs must be 0")
    fields.only(body, "echo", (False,), "echo is not supported")
    fields.only(body, "suffix", ("",), "suffix is not supported")
    params.logprobs = n_logprobs is not None
    api_id = f"cmpl-{uuid.uuid4().hex}"
    prompts = _prompts(body)
    inputs = []
    for k, prompt in enumerate(prompts):
        req = _base_request(body, params)
        req.request_id = api_id if len(prompts) == 1 else f"{api_id}-{k}"
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        inputs.append(req)
    single = isinstance(body["prompt"], str) or not isinstance(body["prompt"][0], (str, list))   # text or ids
    names = ("prompt",) if single else tuple(f"prompt[{k}]" for k in range(len(prompts)))
    return _finish(body, COMPLETION, api_id, tuple(inputs), params.logprobs, max_field, names)


def _finish(body: dict, kind: str, api_id: str, inputs: tuple, logprobs: bool, max_field: str,
            names: tuple[str, ...]) -> ApiRequest:
    n = fields.integer(body, "n", 1, 1)
    if n != 1:
        raise bad_request("n", "only n = 1 is supported for now; send n requests (with different seeds)")
    if fields.integer(body, "best_of", 1, 1) != 1:
        raise bad_request("best_of", "only best_of = 1 is supported")
    fields.only(body, "logit_bias", ({},), "logit_bias is not supported")
    fmt = fields.obj(body, "response_format")
    if fmt is not None and fmt.get("type") != "text":
        raise bad_request("response_format", "only {\"type\": \"text\"} is supported")
    stream = fields.boolean(body, "stream", False)
    opts = fields.obj(body, "stream_options") or {}
    include_usage = fields.boolean(opts, "include_usage", False)
    continuous = fields.boolean(opts, "continuous_usage_stats", False)
    return ApiRequest(kind, api_id, fields.string(body, "model"), inputs, stream, stream and include_usage,
                      stream and continuous, logprobs, max_field, names)


def _sampling(body: dict, default_max_tokens: int | None) -> tuple[common_pb2.SamplingParams, str]:
    """The sampling parameters; their ranges are checked by the request path."""
    p = common_pb2.SamplingParams(
        temperature=fields.number(body, "temperature", 1.0),
        top_p=fields.number(body, "top_p", 1.0, 0.0, lo_open=True),
        top_k=fields.integer(body, "top_k", -1, -1, 2**31 - 1),
        min_p=fields.number(body, "min_p", 0.0),
        presence_penalty=fields.number(body, "presence_penalty", 0.0),
        frequency_penalty=fields.number(body, "frequency_penalty", 0.0),
        repetition_penalty=fields.number(body, "repetition_penalty", 1.0, 0.0, lo_open=True),
        ignore_eos=fields.boolean(body, "ignore_eos", False),
    )
    seed = fields.integer(body, "seed", None, 0, 2**64 - 1)
    if seed is not None:
        p.seed = seed
    max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    p.max_tokens = fields.integer(body, max_field, default_max_tokens, 1, 2**32 - 1) or 0
    p.stop.extend(fields.string_list(body, "stop"))
    p.stop_token_ids.extend(fields.int_list(body, "stop_token_ids"))
    return p, max_field


def _base_request(body: dict, params: common_pb2.SamplingParams) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(
        params=params,
        keep_special_tokens=not fields.boolean(body, "skip_special_tokens", True),
        include_stop_str_in_output=fields.boolean(body, "include_stop_str_in_output", False))
    if body.get("add_special_tokens") is not None:
        req.add_special_tokens = fields.boolean(body, "add_special_tokens", True)
    return req


def _messages(body: dict) -> router_pb2.ChatMessages:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages", "must be a non-empty list of messages")
    out = router_pb2.ChatMessages()
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(f"messages[{i}].role", "must be a non-empty string")
        if m.get("tool_calls"):
            raise bad_request(f"messages[{i}].tool_calls", "tool calls are not supported")
        out.messages.add(role=role, content=_content(m.get("content"), f"messages[{i}].content"))
    return out


def _content(content: object, name: str) -> str:
    """A message's content: a string, or a list of text parts (joined with newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(name, "must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{name}[{j}].type", f"only text content is served, got {kind!r}")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{name}[{j}].text", "must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _prompts(body: dict) -> list[str | list[int]]:
    """``prompt`` as a list of prompts (text or token ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("prompt", "must be a string, a list of strings, token ids or a list of token-id lists")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [fields.int_list(body, "prompt")]
    if len(prompt) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    out: list[str | list[int]] = []
    for k, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, list):
            out.append(fields.int_list({f"prompt[{k}]": p}, f"prompt[{k}]"))
        else:
            raise bad_request(f"prompt[{k}]", "must be a string or a list of token ids")
    return out
