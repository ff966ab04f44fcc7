"""Output text of one request: incremental detokenization and stop strings (pure, no I/O).

Text that could still be the start of a stop string is held back, so a stop string spanning two
steps is never partly sent. On a match the text is cut before it (after it with
``include_stop_str_in_output``) and the request ends with STOP, ``matched_stop`` naming the string.
Before ``min_tokens`` tokens no stop string is looked for (as the workers never sample a stop id
then): text ending before that point can never match. Detokenization runs once per step over all
tokens since the last message.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.common.outputs import SequenceOutput


@dataclass(slots=True)
class TextOutput(SequenceOutput):
    """A step's :class:`SequenceOutput` as the router hands it to its front ends (gRPC, OpenAI,
    KServe), with the text it added. The last one (``finish_reason`` set) also carries the
    request's token accounting (``num_prompt_tokens``, ``num_cached_tokens``,
    ``num_output_tokens``) and, when a stop string ended it (``finish_reason`` STOP), that
    string in ``matched_stop``."""

    text: str = ""
    matched_stop: str | None = None
    num_output_tokens: int = 0       # tokens generated in all (the last output only)


@dataclass
class Delta:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    matched_stop: str | None = None    # set when a stop string ended the request


class OutputProcessor:
    def __init__(self, tokenizer: object | None, stop: Sequence[str] = (),
                 include_stop: bool = False, skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop
        self.max_stop = max((len(s) for s in self.stop), default=0)
        self.num_tokens = 0
        self.emitted = 0          # characters of the text already sent
        self.searched = 0         # text before this index holds no stop string start
        self.final_text: str | None = None
        self.matched_stop: str | None = None
        self.min_tokens = min_tokens

    @property
    def text(self) -> str:
        if self.final_text is not None:
            return self.final_text
        return self.detok.text if self.detok is not None else ""

    def step(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Tokens of one step (all that came since the last message) -> (text to send, the stop
        string that ended the request or None)."""
        self.num_tokens += len(token_ids)
        detok = self.detok
        if detok is None or self.final_text is not None or not token_ids:
            return "", None
        delta = detok.add(token_ids if type(token_ids) is list else list(token_ids))
        if not self.stop:          # nothing is ever held back: the delta is what goes out
            self.emitted += len(delta)
            return delta, None
        return self._advance(detok.text, final=False)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float] = ()) -> Delta:
        """Tokens of one step -> what to send for them."""
        text, matched = self.step(token_ids)
        return Delta(list(token_ids), list(logprobs), text, matched)

    def finish(self) -> Delta:
        """The end of generation: flush held-back text (a stop string may still match)."""
        delta = Delta()
        detok = self.detok
        if detok is None or self.final_text is not None:
            return delta
        detok.flush()
        delta.text, delta.matched_stop = self._advance(detok.text, final=True)
        return delta

    def _advance(self, full: str, final: bool) -> tuple[str, str | None]:
        """``full``: the detokenized text so far."""
        if self.stop and self.num_tokens < self.min_tokens and not final:
            self.searched = max(self.searched, len(full))     # this text stops nothing
        elif self.stop:
            hit = self._find_stop(full)
            if hit is not None:
                index, stop = hit
                self.final_text = full[:index + (len(stop) if self.include_stop else 0)]
                self.matched_stop = stop
                out = self.final_text[self.emitted:]
                self.emitted = len(self.final_text)
                return out, stop
            self.searched = max(0, len(full) - self.max_stop + 1)
        safe = len(full) if final else len(full) - self._holdback(full)
        out = full[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return out, None

    def _find_stop(self, full: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = full.find(s, self.searched)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _holdback(self, full: str) -> int:
        keep = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(full)), keep, -1):
                if full.endswith(s[:k]):
                    keep = k
                    break
        return keep
