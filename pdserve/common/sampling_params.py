"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300          # entries of logit_bias (OpenAI's limit)
LOGIT_BIAS_RANGE = 100.0      # each bias in [-100, 100]
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
    at each position; ``prompt_logprobs`` (needs ``logprobs``) also returns every prompt token's
    logprob after the first (and its top ``top_logprobs``), computed by the prefill, which then
    skips the prefix cache; ``guide`` constrains the output (the engine masks the logits before
    sampling, greedy or random). ``logit_bias`` ((token id, bias) pairs, bias in [-100, 100],
    ids unique) is added to the logits before sampling; ``min_tokens`` (<= max_tokens, not with a
    guide) masks the EOS ids (unless ``ignore_eos``) and ``stop_token_ids`` until that many tokens
    exist. ``n`` (>= 1) samples share one prefill: the engine forks the prompt's KV into n
    sequences (engine/fork.py), sample ``i`` drawing with ``seed + i`` when seeded.
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
    prompt_logprobs: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    n: int = 1

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
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n}")
        _check(isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        _check(self.logprobs or not self.top_logprobs, "top_logprobs", "needs logprobs")
        _check(self.logprobs or not self.prompt_logprobs, "prompt_logprobs", "needs logprobs")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _check(not (self.min_tokens and self.guide is not None), "min_tokens",
               "cannot be combined with a guide (a finished grammar allows only EOS)")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of sample ``index`` of an ``n``-sample request: one sample (n 1), its
        own seed stream (``seed + index``, modulo 2**64: a seed may be any uint64), no prompt
        logprobs (sample 0 carries them)."""
        seed = None if self.seed is None else (self.seed + index) % 2**64
        return replace(self, n=1, seed=seed, prompt_logprobs=self.prompt_logprobs and index == 0)

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _logit_bias(pairs) -> tuple[tuple[int, float], ...]:
    """``pairs`` as a tuple of (int id, float bias), checked: unique ids >= 0, finite biases in
    range, at most MAX_LOGIT_BIAS (the vocabulary bound is the caller's: it knows the model)."""
    out = tuple((int(t), float(b)) for t, b in pairs)
    _check(len(out) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(out)}")
    _check(len({t for t, _ in out}) == len(out), "logit_bias", "token ids must be unique")
    for t, b in out:
        _check(t >= 0, "logit_bias", f"token id must be >= 0, got {t}")
        _check(-LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE, "logit_bias",
               f"bias of token {t} must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {b}")
    return out


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidParameter(name, message)


class InvalidParameter(ValueError):
    """A request parameter is out of range; ``field`` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
