"""What a request produced in one step, as every layer above the engine names it (no protobuf).

A worker turns the engine's per-step batch (``StepOutput``) into one :class:`SequenceOutput` per
request; the wire carries it as ``pdserve.v1.SequenceOutput``; the router merges them per
request and hands the same type to each front end (gRPC, OpenAI HTTP, KServe)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class FinishReason(Enum):
    STOP = "stop"            # eos, a stop token id or a stop string
    LENGTH = "length"        # max_tokens or the model's context
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"


TopLogprobs = tuple[list[int], list[float]]   # a position's most likely token ids and their logprobs


@dataclass(slots=True)
class SequenceOutput:
    """New tokens of one request since its last output. ``num_prompt_tokens`` is set once, on
    the request's first output; ``finish_reason`` on its last. ``top_logprobs``: one entry per
    token when the request asked for them; ``prompt_logprobs`` / ``prompt_top_logprobs``: prompt
    tokens 1..n-1, in the first output only (SamplingParams.prompt_logprobs). ``index``: which
    sample of the request (SamplingParams.n) the output belongs to; the prompt fields come with
    sample 0's only."""
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    index: int = 0
