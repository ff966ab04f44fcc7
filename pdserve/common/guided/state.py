"""Guides compiled against the model's tokenizer (one :class:`GuideCompiler` per engine) and
the per-sequence grammar state (:class:`GuideState`), whose matcher fills the sequence's row of a
step's token bitmask (pdserve.common.guided.bitmask; :func:`fill_bitmask` for one step).

Invariant: a GuideState has accepted exactly ``num_accepted`` leading completion tokens of its
Sequence. ``advance`` catches up from the sequence's tokens, so the state follows whatever the
sequence holds: the first token a prefill worker sampled (a decode worker's sequence gets it at
admission), tokens kept over a preemption (recompute keeps the completion), tokens appended
offline. The engine advances it after every accepted token; the bitmask's fill catches up too.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import torch

from pdserve.common.guided.bitmask import GuidedSequence, StepBitmask
from pdserve.common.guided.grammar import to_grammar
from pdserve.common.sampling_params import Guide, InvalidParameter

if TYPE_CHECKING:
    import xgrammar

MAX_COMPILED = 256      # compiled grammars kept per engine (least recently used dropped)


class GuideCompiler:
    """Compiles Guides for one model (xgrammar TokenizerInfo built on first use), keeping the most
    recent ``MAX_COMPILED``. ``vocab_size``: the model's (its logits' width); ``stop_token_ids``:
    what ends a grammar's output (the engine's EOS ids); ``tokenizer``: the HF tokenizer, or None
    for a model without one. Grammars cover ``grammar_vocab_size`` tokens: the tokenizer's
    vocabulary, not the ids the model has beyond it (no text: never allowed, and costly to
    xgrammar's fill and accept, which reject such ids one by one; the bitmask forbids them)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Seq[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: OrderedDict[Guide, xgrammar.CompiledGrammar] = OrderedDict()

    @property
    def grammar_vocab_size(self) -> int:
        """Tokens a grammar covers: the tokenizer's ids (and the stop ids), at most the model's."""
        vocab = self.tokenizer.get_vocab()
        ids = [len(vocab), max(vocab.values(), default=-1) + 1, *(t + 1 for t in self.stop_token_ids)]
        return min(self.vocab_size, max(ids))

    def _grammar_compiler(self, guide: Guide) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidParameter(f"guide.{guide.kind}", "guided decoding needs the model's tokenizer; "
                                                              "this model has none")
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.grammar_vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def compile(self, guide: Guide) -> xgrammar.CompiledGrammar:
        """The compiled grammar of ``guide``; raises InvalidParameter naming ``guide.<kind>``."""
        compiled = self._compiled.get(guide)
        if compiled is not None:
            self._compiled.move_to_end(guide)
            return compiled
        compiler = self._grammar_compiler(guide)
        grammar = to_grammar(guide)
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar's RuntimeError, named for the request
            raise InvalidParameter(f"guide.{guide.kind}", f"cannot be compiled: {e}") from e
        self._compiled[guide] = compiled
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def new_state(self, guide: Guide) -> GuideState:
        return GuideState(self.compile(guide))


class GuideState:
    """One sequence's place in its grammar. ``failed``: a token the grammar refuses was kept
    (never from this engine's own sampling; the engine ends such a sequence with an error)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar) -> None:
        import xgrammar as xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size     # the grammar's tokens (ids below it)
        self.num_accepted = 0
        self.failed = False

    def advance(self, completion_token_ids: Seq[int]) -> bool:
        """Accept the completion tokens not accepted yet, up to the first one not known yet (a
        negative placeholder); False once one was refused."""
        while not self.failed and self.num_accepted < len(completion_token_ids):
            token = int(completion_token_ids[self.num_accepted])
            if token < 0:
                break
            if token >= self.vocab_size or not self.matcher.accept_token(token):
                self.failed = True
            self.num_accepted += 1
        return not self.failed

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()


def fill_bitmask(seqs: Seq[GuidedSequence], vocab_size: int, pin: bool = False) -> torch.Tensor | None:
    """One step's host token bitmask ``[len(seqs), ceil(vocab_size / 32)]`` int32 (see
    ``StepBitmask.fill``, which an engine keeps to reuse its buffer from step to step)."""
    return StepBitmask(vocab_size, pin).fill(seqs)
