"""OpenAI request bodies -> ``pdserve.v1.GenerateRequest`` messages for the request path.

Only the JSON is checked here (types, and 0 for ``max_tokens``, ``top_p``, ``repetition_penalty``);
ranges, the prompt and the context are checked once by
:meth:`pdserve.router.servicer.GenerationServicer.job`. ``n`` > 1 becomes one GenerateRequest per
prompt asking for n samples (``params.n``: the workers prefill once and fork, sample i seeded
``seed + i``), listed once per choice in ``inputs``; structured outputs (structured.py) and
tools (tools.py) become a guide.
Log-probabilities: chat ``logprobs`` + ``top_logprobs`` (0..20), completions ``logprobs`` (an
integer 0..20: the top count); completions ``echo`` returns the prompt first, with its
logprobs (SamplingParams.prompt_logprobs) when ``logprobs`` is set; with ``max_tokens`` 0 only
the prompt (as vLLM: one token is generated and dropped, finish reason ``length``). ``logit_bias`` (token id
string -> bias) and vLLM's ``min_tokens`` go to the sampler. ``best_of`` > n samples best_of per
prompt (their logprobs computed for the ranking) and answers the n with the highest cumulative
logprob (not streamed, as OpenAI). Unsupported fields (suffix) are refused with a 400 naming the
field; unknown ones are ignored.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass

from pdserve.router.openai_api import fields
from pdserve.router.openai_api.errors import bad_request
from pdserve.router.openai_api.structured import GuideRequest, parse_guide
from pdserve.router.openai_api.tools import ToolRequest, parse_tools, tool_guide
from pdserve.v1 import common_pb2, router_pb2

MAX_PROMPTS = 64          # choices of one request: prompts times n
MAX_TOP_LOGPROBS = 20
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
    n: int = 1                                  # samples per prompt: inputs[k * n + i] (best_of)
    guide_param: str = ""                       # the body field of the guide (errors), "" = none
    tools: ToolRequest | None = None
    chat_messages: tuple[dict, ...] = ()        # set when the front renders the chat (tools)
    add_generation_prompt: bool = True
    top_logprobs: int = 0                       # most likely tokens per position (logprobs only)
    echo: bool = False                          # completions: the prompt comes first
    keep: int = 0                               # best_of > n: the n samples answered per prompt
    echo_only: bool = False                     # echo with max_tokens 0: the prompt, no generated token


def parse_chat(body: dict) -> ApiRequest:
    params, max_field = _sampling(body, None)
    logprobs = fields.boolean(body, "logprobs", False)
    top = fields.integer(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    tools = parse_tools(body)
    guide = _guide(params, parse_guide(body), tool_guide(tools) if tools is not None else None)
    params.logprobs, params.top_logprobs = logprobs, top
    req = _base_request(body, params)
    add_prompt = fields.boolean(body, "add_generation_prompt", True)
    rendered: tuple[dict, ...] = ()
    if tools is not None or _has_tool_turns(body):
        rendered = tuple(_tool_messages(body))      # the front renders them (tools.render)
    else:
        req.chat.CopyFrom(_messages(body))
        req.skip_generation_prompt = not add_prompt
    api_id = f"chatcmpl-{uuid.uuid4().hex}"
    req.request_id = api_id
    api = _finish(body, CHAT, api_id, (req,), logprobs, max_field, ("messages",))
    return dataclasses.replace(api, guide_param=guide, tools=tools, chat_messages=rendered,
                               add_generation_prompt=add_prompt, top_logprobs=top)


def parse_completion(body: dict) -> ApiRequest:
    echo = fields.boolean(body, "echo", False)
    params, max_field = _sampling(body, COMPLETION_DEFAULT_MAX_TOKENS, 0 if echo else 1)
    echo_only = echo and body.get(max_field) == 0
    if echo_only:          # the prompt alone: one token is sampled (a prefill makes one) and dropped
        params.max_tokens = 1
    guide = _guide(params, parse_guide(body))
    n_logprobs = fields.integer(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    fields.only(body, "suffix", ("",), "suffix is not supported")
    params.logprobs = n_logprobs is not None
    params.top_logprobs = n_logprobs or 0
    params.prompt_logprobs = echo and params.logprobs
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
    api = _finish(body, COMPLETION, api_id, tuple(inputs), params.logprobs, max_field, names)
    return dataclasses.replace(api, guide_param=guide, top_logprobs=params.top_logprobs, echo=echo,
                               echo_only=echo_only)


def _finish(body: dict, kind: str, api_id: str, inputs: tuple, logprobs: bool, max_field: str,
            names: tuple[str, ...]) -> ApiRequest:
    n = fields.integer(body, "n", 1, 1, MAX_PROMPTS) or 1
    if n * len(inputs) > MAX_PROMPTS:
        raise bad_request("n", f"n ({n}) times the prompts ({len(inputs)}) is over {MAX_PROMPTS} choices")
    best_of = fields.integer(body, "best_of", None, 1) or n
    if best_of < n:
        raise bad_request("best_of", f"must be >= n ({n}), got {best_of}")
    if best_of * len(inputs) > MAX_PROMPTS:
        raise bad_request("best_of", f"best_of ({best_of}) times the prompts ({len(inputs)}) is over "
                                     f"{MAX_PROMPTS} samples")
    stream = fields.boolean(body, "stream", False)
    if stream and best_of > n:
        raise bad_request("best_of", "a request with best_of > n cannot be streamed")
    opts = fields.obj(body, "stream_options") or {}
    include_usage = fields.boolean(opts, "include_usage", False)
    continuous = fields.boolean(opts, "continuous_usage_stats", False)
    if best_of > n:
        for req in inputs:
            req.params.logprobs = True          # the ranking's; answered only when asked
    inputs, names = _fan_out(inputs, names, best_of)
    return ApiRequest(kind, api_id, fields.string(body, "model"), inputs, stream, stream and include_usage,
                      stream and continuous, logprobs, max_field, names, best_of,
                      keep=n if best_of > n else 0)


def _fan_out(inputs: tuple, names: tuple[str, ...], n: int) -> tuple[tuple, tuple[str, ...]]:
    """Each input asks for ``n`` samples (``params.n``) and stands for choices ``k * n`` ..
    ``k * n + n - 1`` (the same message n times: one request per input reaches the router)."""
    if n == 1:
        return inputs, names
    for req in inputs:
        req.params.n = n
    return tuple(r for r in inputs for _ in range(n)), tuple(nm for nm in names for _ in range(n))


def _guide(params: common_pb2.SamplingParams, *found: GuideRequest | None) -> str:
    """Put the one guide of ``found`` into ``params``; its body field ("" when none)."""
    guides = [g for g in found if g is not None]
    if len(guides) > 1:
        raise bad_request(guides[1].param, f"cannot be combined with {guides[0].param}")
    if not guides:
        return ""
    params.guide.CopyFrom(guides[0].guide)
    return guides[0].param


def _sampling(body: dict, default_max_tokens: int | None, min_max_tokens: int = 1
              ) -> tuple[common_pb2.SamplingParams, str]:
    """The sampling parameters; their ranges are checked by the request path (``max_tokens``
    here: at least ``min_max_tokens``)."""
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
    p.max_tokens = fields.integer(body, max_field, default_max_tokens, min_max_tokens, 2**32 - 1) or 0
    p.stop.extend(fields.string_list(body, "stop"))
    p.stop_token_ids.extend(fields.int_list(body, "stop_token_ids"))
    p.min_tokens = fields.integer(body, "min_tokens", 0, 0, 2**32 - 1) or 0
    for token, bias in _logit_bias(body).items():
        p.logit_bias[token] = bias
    return p, max_field


def _logit_bias(body: dict) -> dict[int, float]:
    """``logit_bias``: token ids (as JSON object keys, strings of digits) -> numbers; the ranges
    are checked by the request path."""
    raw = fields.obj(body, "logit_bias") or {}
    out = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < 2**32):
            raise bad_request("logit_bias", f"keys must be token ids, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad_request("logit_bias", f"the bias of {key} must be a number, got {value!r}")
        out[int(key)] = float(value)
    return out


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
        out.messages.add(role=role, content=_content(m.get("content"), f"messages[{i}].content"))
    return out


def _has_tool_turns(body: dict) -> bool:
    msgs = body.get("messages")
    return isinstance(msgs, list) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                          for m in msgs)


def _tool_messages(body: dict) -> list[dict]:
    """The messages as plain dicts for a render with tools: text content, checked tool calls."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise bad_request(f"messages[{i}].role", "must be a non-empty string")
        msg: dict = {"role": m["role"], "content": _content(m.get("content"), f"messages[{i}].content")}
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad_request(f"messages[{i}].tool_calls", "must be a list")
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or \
                    not isinstance(fn.get("arguments"), (str, dict)):
                raise bad_request(f"messages[{i}].tool_calls[{j}]", "must have function.name and function.arguments")
        if calls:
            msg["tool_calls"] = calls
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = fields.string(m, "tool_call_id")
        out.append(msg)
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
