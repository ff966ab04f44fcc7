"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20
GUIDE_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Guide:
    """A formal language the output must belong to (guided decoding / structured outputs).

    ``kind`` is one of GUIDE_KINDS; ``value`` is the JSON Schema as JSON text (json_schema), the
    regular expression (regex) or the EBNF grammar with a ``root`` rule (grammar), empty for
    json_object; ``choices`` (choice only) are the strings the output may be. Only the shape is
    checked here; whether the schema, regex or grammar compiles is checked by
    ``pdserve.common.guided.check_guide`` (the converter calls it).
    """

    kind: str
    value: str = ""
    choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check(self.kind in GUIDE_KINDS, "guide", f"kind must be one of {', '.join(GUIDE_KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            _check(bool(self.choices) and all(self.choices), "guide.choice",
                   "must be a non-empty list of non-empty strings")
        elif self.kind != "json_object":
            _check(bool(self.value), f"guide.{self.kind}", "must not be empty")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    temperature 0 = greedy; top_k -1 or 0 = off; top_p in (0, 1]; min_p in [0, 1];
    repetition_penalty (1.0 = off) scales logits of tokens seen in prompt or output,
    presence/frequency_penalty (0.0 = off) subtract for tokens seen in the output. ``seed``
    makes a sampled request reproducible; ``logprobs`` returns each chosen token's raw logprob,
    ``top_logprobs`` (0..20, needs ``logprobs``) also the most likely tokens' ids and raw logprobs
    at each position; ``guide`` constrains the output (the engine masks the logits before
    sampling, greedy or random).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    guide: Guide | None = None

    def __post_init__(self) -> None:
        _check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1 (off) or >= 0, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens}")
        _check(self.seed is None or self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(self.logprobs or not self.top_logprobs, "top_logprobs", "needs logprobs")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(name, message)


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
