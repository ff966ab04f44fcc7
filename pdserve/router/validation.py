"""The router's request checks: sampling parameters (through the one converter,
pdserve.common.grpc_utils.convert, plus the router's stop strings) and prompt bounds at the door.
Errors are INVALID_ARGUMENT naming the field.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pdserve.common.grpc_utils import InvalidArgument
from pdserve.common.grpc_utils.convert import sampling_params_from_proto
from pdserve.common.sampling_params import SamplingParams
from pdserve.v1 import common_pb2

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


@dataclass(frozen=True)
class RequestParams:
    """Validated sampling (max_tokens still 0 when the client left it to the server) plus the
    router-side stopping fields."""

    sampling: SamplingParams
    max_tokens: int                 # 0 = fill the context
    stop: tuple[str, ...] = ()


def from_proto(p: common_pb2.SamplingParams, vocab_size: int, has_tokenizer: bool) -> RequestParams:
    """Check ``p`` (stop strings here, the rest in the converter); ``sampling.max_tokens`` is a
    placeholder until :meth:`ParamsCache.resolve` knows the prompt."""
    stop = tuple(p.stop)
    if stop and not has_tokenizer:
        raise InvalidArgument("params.stop", "stop strings need a tokenizer; this model has none")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("params.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    for i, s in enumerate(stop):
        if not s or len(s) > MAX_STOP_CHARS:
            raise InvalidArgument(f"params.stop[{i}]", f"must be 1..{MAX_STOP_CHARS} characters long")
    sampling = sampling_params_from_proto(p, rest_of_context=max(1, p.min_tokens), vocab_size=vocab_size)
    return RequestParams(sampling, int(p.max_tokens), stop)


class ParamsCache:
    """Validated sampling parameters by their wire bytes, with their resolved forms.

    Clients send the same few parameter sets again and again; a lookup by the serialized
    message is cheaper than validating it again. Errors are never cached. Bounded: cleared
    when full. The cached objects are shared (SamplingParams is frozen).
    """

    def __init__(self, vocab_size: int, has_tokenizer: bool, max_entries: int = 1024) -> None:
        self.vocab_size = vocab_size
        self.has_tokenizer = has_tokenizer
        self.max_entries = max_entries
        self._params: dict[bytes, RequestParams] = {}
        self._resolved: dict[tuple[bytes, int], SamplingParams] = {}

    def validate(self, p: common_pb2.SamplingParams) -> tuple[bytes, RequestParams]:
        """(cache key, :func:`from_proto` of ``p``); raises as from_proto does."""
        key = p.SerializeToString(deterministic=True)
        params = self._params.get(key)
        if params is None:
            params = from_proto(p, self.vocab_size, self.has_tokenizer)
            if len(self._params) >= self.max_entries:
                self._params.clear()
            self._params[key] = params
        return key, params

    def resolve(self, key: bytes, params: RequestParams, max_tokens: int) -> SamplingParams:
        """The sampling with the effective ``max_tokens`` (what the workers get: the worker
        client converts it, pdserve.common.grpc_utils.convert.sampling_params_to_proto)."""
        out = self._resolved.get((key, max_tokens))
        if out is None:
            out = dataclasses.replace(params.sampling, max_tokens=max_tokens,   # min_tokens within it
                                      min_tokens=min(params.sampling.min_tokens, max_tokens))
            if len(self._resolved) >= self.max_entries:
                self._resolved.clear()
            self._resolved[(key, max_tokens)] = out
        return out


# ---------------------------------------------------------------- prompt size at the door
# UTF-8 encodes a character in at most 4 bytes.
MAX_UTF8_BYTES_PER_CHAR = 4
# Without a tokenizer only token ids are accepted; this bound is not used then.
DEFAULT_MAX_TOKEN_CHARS = 64


def max_token_chars(hf_tokenizer: object) -> int:
    """The longest vocabulary entry in characters: no token covers more characters of the
    input, so a text of ``n`` characters needs at least ``n / max_token_chars`` tokens."""
    get_vocab = getattr(hf_tokenizer, "get_vocab", None)
    vocab = get_vocab() if get_vocab is not None else {}
    return max((len(piece) for piece in vocab), default=DEFAULT_MAX_TOKEN_CHARS) or 1


@dataclass(frozen=True)
class PromptBounds:
    """What a prompt may be at most, derived from the model's context, checked before any
    tokenization: a larger prompt can never fit, however it tokenizes. Characters: the context
    times the longest token (in characters); bytes (UTF-8): 4 times that; token ids: the
    context."""

    max_model_len: int
    max_token_chars: int

    def __post_init__(self) -> None:
        if self.max_model_len <= 0 or self.max_token_chars <= 0:
            raise ValueError(f"bad prompt bounds {self}")

    @property
    def max_chars(self) -> int:
        return self.max_model_len * self.max_token_chars

    @property
    def max_bytes(self) -> int:
        return self.max_chars * MAX_UTF8_BYTES_PER_CHAR

    @property
    def max_request_bytes(self) -> int:
        """The public port's message-size limit: the largest prompt that can fit plus 1 MiB for
        the rest of a request (at least 4 MiB). grpc refuses a larger message
        (RESOURCE_EXHAUSTED) as soon as its length prefix arrives, before reading it."""
        return max(4 << 20, self.max_bytes + (1 << 20))

    def _too_long(self, field: str, chars: int, what: str = "characters") -> InvalidArgument:
        return InvalidArgument(field, f"prompt of {chars} {what} cannot fit the model's context of "
                                      f"{self.max_model_len} tokens (at most {self.max_chars} characters, "
                                      f"{self.max_bytes} bytes); it was not tokenized")

    def _check_text(self, field: str, chars: int, texts: list[str]) -> None:
        if chars > self.max_chars:
            raise self._too_long(field, chars)
        if chars * MAX_UTF8_BYTES_PER_CHAR > self.max_bytes:   # only then can the bytes be over
            nbytes = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts)
            if nbytes > self.max_bytes:
                raise self._too_long(field, nbytes, "bytes")

    def check(self, request: object) -> None:
        """INVALID_ARGUMENT when a GenerateRequest / TokenizeRequest's input is over the bounds
        (O(1) for text and token ids; O(messages) for chat)."""
        kind = request.WhichOneof("input")  # type: ignore[attr-defined]
        if kind == "text":
            text = request.text  # type: ignore[attr-defined]
            self._check_text("text", len(text), [text])
        elif kind == "chat":
            contents = [m.content for m in request.chat.messages]  # type: ignore[attr-defined]
            roles = [m.role for m in request.chat.messages]  # type: ignore[attr-defined]
            self._check_text("chat.messages", sum(map(len, contents)) + sum(map(len, roles)), contents + roles)
        elif kind == "token_ids":
            n = len(request.token_ids.ids)  # type: ignore[attr-defined]
            if n >= self.max_model_len:
                raise InvalidArgument("token_ids.ids", f"prompt has {n} tokens; the model's context is "
                                                       f"{self.max_model_len} (prompt + at least 1 output token)")
