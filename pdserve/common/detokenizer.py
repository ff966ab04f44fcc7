"""Incremental detokenization: the text each new token adds, without re-decoding everything.

Uses ``tokenizers.decoders.DecodeStream`` when the tokenizer allows it (same text), else the
two-offset algorithm in Python. A delta ending in an incomplete UTF-8 sequence is held back
until the next token completes it.
"""
from __future__ import annotations

from typing import Any


def stream_backend(tokenizer: Any) -> Any | None:
    """The Rust tokenizer whose decode equals ``tokenizer.decode`` (a router tokenizer or a
    transformers fast tokenizer without clean-up), or None."""
    hf = getattr(tokenizer, "hf", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
        return None
    return backend


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self._backend = stream_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (may be empty)."""
        self.token_ids.extend(new_token_ids)
        if self._stream is not None and self._backend is not None:   # set together
            delta = self._stream.step(self._backend, new_token_ids) or ""
        else:
            delta = self._offsets_delta()
        self.text += delta
        return delta

    def _offsets_delta(self) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever was held back (even if it is an incomplete character)."""
        full = self._decode(self.token_ids)
        delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta
