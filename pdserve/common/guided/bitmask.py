"""A step's token bitmask on the host, filled for the whole batch at once (:class:`StepBitmask`).

Cost model (xgrammar 0.2.8): a matcher's fill and accept scale with its grammar's vocabulary,
every id past the tokenizer's own vocabulary included (such an id is a "special" token that
xgrammar rejects one by one). Grammars are therefore compiled against the tokenizer's vocabulary
(``GuideCompiler.grammar_vocab_size``) and the ids the model has beyond it (padding rows of its
embedding) are forbidden here, word by word: the same mask, without xgrammar touching them.
The guided rows are filled by one ``BatchGrammarMatcher`` call on ``fill_threads`` threads
(outside the GIL), into one host buffer reused from step to step (pinned on CUDA: its copy to
the device is asynchronous, and the next fill waits for that copy only). The buffer's other
writes go through numpy: torch's intra-op threads made these small copies erratic (milliseconds
on a busy host).
"""
from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.common.layers.token_mask import BITS, bitmask_words

if TYPE_CHECKING:
    import xgrammar

MAX_FILL_THREADS = 8     # threads of one batch fill (at most the cores this process may use)
ROWS_PER_THREAD = 16     # rows a fill thread gets at least (xgrammar starts its threads per call)


class Guided(Protocol):
    """What the bitmask reads of a grammar state (state.GuideState is one)."""

    matcher: xgrammar.GrammarMatcher
    vocab_size: int     # the grammar's tokens: ids below it

    def advance(self, completion_token_ids: Seq[int]) -> bool: ...
    @property
    def is_terminated(self) -> bool: ...


class GuidedSequence(Protocol):
    """What the bitmask reads of a sequence (the engine's Sequence is one)."""

    @property
    def guide(self) -> Guided | None: ...
    @property
    def completion_token_ids(self) -> list[int]: ...


def fill_threads(rows: int) -> int:
    """Threads a batch fill of ``rows`` rows uses: one per ``ROWS_PER_THREAD`` rows (a thread
    costs more than a few rows' fill), at most the cores this process may run on and
    MAX_FILL_THREADS."""
    return max(1, min(MAX_FILL_THREADS, len(os.sched_getaffinity(0)), rows // ROWS_PER_THREAD))


class StepBitmask:
    """The host token bitmask of one engine's steps, ``[rows, ceil(vocab_size / 32)]`` int32
    (``vocab_size``: the model's, the sampler's logit width). ``fill`` returns a view of a buffer
    that the next ``fill`` overwrites; ``upload`` copies it to the device."""

    def __init__(self, vocab_size: int, pin: bool = False) -> None:
        self.vocab_size = int(vocab_size)
        self.words = bitmask_words(self.vocab_size)
        self.pin = pin
        self._host = torch.empty(0, self.words, dtype=torch.int32)
        self._narrow: dict[int, torch.Tensor] = {}          # grammar width -> contiguous scratch rows
        self._batch: dict[int, xgrammar.BatchGrammarMatcher] = {}     # by thread count
        self._copied: torch.cuda.Event | None = None

    def fill(self, seqs: Seq[GuidedSequence]) -> torch.Tensor | None:
        """This step's bitmask ``[len(seqs), words]``: each guided state first caught up with its
        sequence, then its allowed next tokens; rows without a guide, and rows whose grammar
        failed or terminated (the engine ends those), allow everything. None when no sequence is
        guided (the sampler then masks nothing)."""
        if not any(s.guide is not None for s in seqs):
            return None
        if self._copied is not None:        # the previous step's copy still reads the buffer
            self._copied.synchronize()
            self._copied = None
        host = self._rows(len(seqs))
        groups: dict[int, tuple[list[int], list[xgrammar.GrammarMatcher]]] = {}
        free = []
        for row, seq in enumerate(seqs):
            state = seq.guide
            if state is not None and state.advance(seq.completion_token_ids) and not state.is_terminated:
                rows, matchers = groups.setdefault(state.vocab_size, ([], []))
                rows.append(row)
                matchers.append(state.matcher)
            else:
                free.append(row)
        for width, (rows, matchers) in groups.items():
            self._fill_group(host, width, rows, matchers)
        if free:
            host.numpy()[free] = -1
        return host

    def upload(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``bitmask`` (from ``fill``) on ``device``; on CUDA an asynchronous copy that the next
        ``fill`` waits for before writing the buffer again."""
        if device.type != "cuda":
            return bitmask.to(device)
        out = bitmask.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    def _rows(self, n: int) -> torch.Tensor:
        """The first ``n`` rows of the host buffer (grown, never shrunk)."""
        if self._host.shape[0] < n:
            self._host = torch.empty(max(n, 2 * self._host.shape[0]), self.words, dtype=torch.int32,
                                     pin_memory=self.pin)
        return self._host[:n]

    def _fill_group(self, host: torch.Tensor, width: int, rows: list[int],
                    matchers: list[xgrammar.GrammarMatcher]) -> None:
        """Rows ``rows`` of ``host`` from matchers of a grammar over ``width`` tokens: xgrammar
        fills ``ceil(width / 32)`` words (straight into ``host`` when that is its width, else into
        a contiguous scratch copied in), and every id from ``width`` up is forbidden."""
        if width > self.vocab_size:
            raise ValueError(f"a grammar over {width} tokens for a model of {self.vocab_size}")
        batch = self._batch_matcher(fill_threads(len(rows)))
        if width == self.vocab_size:
            batch.batch_fill_next_token_bitmask(matchers, host, rows)
            return
        words = bitmask_words(width)
        scratch = self._scratch(width, len(rows))
        batch.batch_fill_next_token_bitmask(matchers, scratch)
        out, narrow = host.numpy(), scratch.numpy()
        if width % BITS:        # the last word's ids from ``width`` up are not the grammar's
            narrow[:, words - 1] &= (1 << (width % BITS)) - 1
        out[rows, :words] = narrow
        out[rows, words:] = 0

    def _scratch(self, width: int, n: int) -> torch.Tensor:
        """``n`` contiguous rows of ``ceil(width / 32)`` words (xgrammar writes rows densely)."""
        buf = self._narrow.get(width)
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, self._host.shape[0]), bitmask_words(width), dtype=torch.int32)
            self._narrow[width] = buf
        return buf[:n]

    def _batch_matcher(self, threads: int) -> xgrammar.BatchGrammarMatcher:
        batch = self._batch.get(threads)
        if batch is None:
            import xgrammar as xgr
            batch = self._batch[threads] = xgr.BatchGrammarMatcher(max_threads=threads)
        return batch
