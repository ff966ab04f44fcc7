"""OpenAI response objects: whole responses, stream chunks, usage and logprobs (pure functions
over plain values, no I/O)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pdserve.common.outputs import FinishReason, TopLogprobs
from pdserve.router.openai_api.requests import CHAT

FINISH_REASONS = {      # a stop string ends with STOP too; the rest: "stop"
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}
DONE = b"data: [DONE]\n\n"


@dataclass
class Choice:
    """What one choice (one prompt) has produced so far."""

    index: int
    prompt_tokens: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)         # echo: prompt tokens 1..n-1
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | None = None
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def sse(obj: dict) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(choices: list[Choice]) -> dict:
    p = sum(c.prompt_tokens for c in choices)
    n = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in choices)}}


def _envelope(kind: str, api_id: str, created: int, model: str, chunk: bool) -> dict:
    obj = "chat.completion.chunk" if kind == CHAT and chunk else kind
    return {"id": api_id, "object": obj, "created": created, "model": model}


def best_of(choices: list[Choice], group: int, keep: int) -> list[int]:
    """Indices of the choices answered when each ``group`` consecutive samples of a prompt keep
    their ``keep`` highest cumulative logprobs (ties: the earlier sample), in answer order."""
    out = []
    for start in range(0, len(choices), group):
        ranked = sorted(range(start, min(start + group, len(choices))), key=lambda i: -sum(choices[i].logprobs))
        out.extend(ranked[:keep])
    return out


def response(kind: str, api_id: str, created: int, model: str, choices: list[Choice],
             logprobs: list[dict | None], messages: list[dict] | None = None,
             usage_of: list[Choice] | None = None) -> dict:
    """The whole (non-streamed) response; ``messages``: chat messages to answer instead of the
    plain text ones (tool calls); ``usage_of``: the choices whose tokens the usage counts
    (default ``choices``; best_of: every sample)."""
    out = _envelope(kind, api_id, created, model, chunk=False)
    items = []
    for k, (c, lp) in enumerate(zip(choices, logprobs)):
        text = "".join(c.texts)
        if kind == CHAT:
            message = messages[k] if messages is not None else {"role": "assistant", "content": text}
            items.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": c.finish_reason})
        else:
            items.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
    out["choices"] = items
    out["usage"] = usage(usage_of if usage_of is not None else choices)
    return out


def chunk(kind: str, api_id: str, created: int, model: str, index: int, text: str, first: bool,
          finish_reason: str | None, logprobs: dict | None, delta: dict | None = None) -> dict:
    """One streamed chunk of one choice; ``delta``: a chat delta to send instead of ``text``'s."""
    out = _envelope(kind, api_id, created, model, chunk=True)
    if kind == CHAT:
        delta = dict(delta) if delta is not None else {"content": text}
        if first:
            delta = {"role": "assistant", **delta}
        item = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        item = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out["choices"] = [item]
    return out


def usage_chunk(kind: str, api_id: str, created: int, model: str, choices: list[Choice]) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the usage."""
    out = _envelope(kind, api_id, created, model, chunk=True)
    out["choices"] = []
    out["usage"] = usage(choices)
    return out
