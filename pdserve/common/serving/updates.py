"""What a worker tells its router about one request after a step (plain data, no protobuf)."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.engine.sequence import FinishReason, Sequence


@dataclass
class SeqUpdate:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str = ""


def finished_update(seq: Sequence, reason: FinishReason, error: str = "") -> SeqUpdate:
    return SeqUpdate(seq.request_id, finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                     num_cached_tokens=seq.num_prefix_hit_tokens, error=error)
