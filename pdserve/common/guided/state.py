"""Guides compiled against the model's vocabulary (one :class:`GuideCompiler` per engine) and
the per-sequence grammar state (:class:`GuideState`), which fills the sequence's row of a step's
token bitmask (:func:`fill_bitmask`).

Invariant: a GuideState has accepted exactly ``num_accepted`` leading completion tokens of its
Sequence. ``advance`` catches up from the sequence's tokens, so the state follows whatever the
sequence holds: the first token a prefill worker sampled (a decode worker's sequence gets it at
admission), tokens kept over a preemption (recompute keeps the completion), tokens appended
offline. The engine advances it after every accepted token; ``fill_bitmask`` catches up too.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pdserve.common.guided.grammar import to_grammar
from pdserve.common.layers.token_mask import bitmask_words
from pdserve.common.sampling_params import Guide, InvalidParameter

if TYPE_CHECKING:
    import xgrammar

MAX_COMPILED = 256      # compiled grammars kept per engine (least recently used dropped)


class GuideCompiler:
    """Compiles Guides for one model's vocabulary (xgrammar TokenizerInfo built on first use),
    keeping the most recent ``MAX_COMPILED``. ``stop_token_ids``: what ends a grammar's output
    (the engine's EOS ids); ``tokenizer``: the HF tokenizer, or None for a model without one."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Seq[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiled: OrderedDict[Guide, xgrammar.CompiledGrammar] = OrderedDict()

    def _grammar_compiler(self, guide: Guide) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            if self.tokenizer is None:
                raise InvalidParameter(f"guide.{guide.kind}", "guided decoding needs the model's tokenizer; "
                                                              "this model has none")
            import xgrammar as xgr
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
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
        self.num_accepted = 0
        self.failed = False

    def advance(self, completion_token_ids: Seq[int]) -> bool:
        """Accept the completion tokens not accepted yet, up to the first one not known yet (a
        negative placeholder); False once one was refused."""
        while not self.failed and self.num_accepted < len(completion_token_ids):
            token = int(completion_token_ids[self.num_accepted])
            if token < 0:
                break
            if not self.matcher.accept_token(token):
                self.failed = True
            self.num_accepted += 1
        return not self.failed

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row ``row`` of the host bitmask (left all-ones,
        unconstrained, when the state failed or terminated: the engine ends the sequence)."""
        if not self.failed and not self.is_terminated:
            self.matcher.fill_next_token_bitmask(bitmask, row)


class GuidedSequence(Protocol):
    """What the bitmask reads of a sequence (the engine's Sequence is one)."""

    @property
    def guide(self) -> GuideState | None: ...
    @property
    def completion_token_ids(self) -> list[int]: ...


def fill_bitmask(seqs: Seq[GuidedSequence], vocab_size: int, pin: bool = False) -> torch.Tensor | None:
    """The step's host token bitmask ``[len(seqs), ceil(vocab_size / 32)]`` int32 (rows without a
    guide allow everything), each guided state first caught up with its sequence; None when no
    sequence is guided (the sampler then masks nothing)."""
    if not any(s.guide is not None for s in seqs):
        return None
    bitmask = torch.full((len(seqs), bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
    for row, seq in enumerate(seqs):
        state = seq.guide
        if state is not None:
            state.advance(seq.completion_token_ids)
            state.fill(bitmask, row)
    return bitmask
