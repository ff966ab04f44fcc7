"""Overlapped steps: step N+1 is launched before the host has read step N's tokens (its
decode rows take their input token on the device), so the host prepares while the GPU runs.

Exactness: a launched sequence holds a PLACEHOLDER until its step resolves (in order); one that
stops on a token value is found a step late and its extra token dropped; a full block reaches
the prefix cache only once its tokens are known; no overlap with penalties (host history).

Guided sequences overlap too. Step N+1's mask needs step N's token accepted by the grammar, so
a step with a guided row that was in step N is launched without its sampling
(``ModelRunner.launch(defer_guided=True)``): its forward and logits are enqueued, then the host
resolves step N (reads its tokens, accepts them into the grammars, finishes what stops, a
grammar's termination included), and only then fills step N+1's bitmask and enqueues its
sampling (``sample``), all while the device runs step N+1's forward. A grammar only ever
accepts known tokens (never a placeholder), so nothing is rolled back: a guided sequence that
finishes on step N has its row of step N+1 sampled under an all-allowing (terminated) or
harmless mask and the token dropped, as for any sequence that stops a step late. Unguided steps
keep one launch that samples.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.engine import fork, guide_stop
from pdserve.common.engine.model_runner import LaunchedStep
from pdserve.common.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class PendingStep:
    seqs: list[Sequence]      # the sequences that get a token from this step (row order)
    launched: LaunchedStep
    positions: list[int]      # where each sequence's placeholder sits
    is_prefill: bool = False
    num_computed_tokens: int = 0
    num_decode_rows: int = 0


def can_overlap(engine) -> bool:
    """May a decode step be launched before the previous step's tokens are read?"""
    sched = engine.scheduler
    return (engine.overlap_enabled and sched.running
            and not any(s.sampling_params.has_penalties for s in sched.running))


def launch(engine, seqs: list[Sequence], is_prefill: bool, prev: PendingStep | None) -> PendingStep:
    """Launch a step; decode rows that were in ``prev`` take their input token on the device. A
    guided row that was in ``prev`` defers the step's sampling to ``sample`` (after ``prev``
    resolves)."""
    src_rows = prev_tokens = None
    defer = False
    if prev is not None and prev.seqs:
        row = {s.seq_id: i for i, s in enumerate(prev.seqs)}
        src_rows = [row.get(s.seq_id, -1) for s in seqs]
        prev_tokens = prev.launched.token_ids
        defer = any(s.guide is not None and r >= 0 for s, r in zip(seqs, src_rows))
    computed = sum(s.num_scheduled_tokens for s in seqs)
    launched = engine.model_runner.launch(seqs, is_prefill, src_rows, prev_tokens, defer_guided=defer)
    if is_prefill and launched.sampled:
        engine.prefill_launched(launched.seqs, launched)
    positions = []
    for s in seqs:
        s.num_cached_tokens += s.num_scheduled_tokens
    for s in launched.seqs:
        positions.append(s.num_tokens)
        s.append_token(PLACEHOLDER)
    num_decode = count_decode_rows(seqs) if is_prefill else len(seqs)
    return PendingStep(launched.seqs, launched, positions, is_prefill, computed, num_decode)


def sample(engine, step: PendingStep | None) -> None:
    """Enqueue ``step``'s deferred sampling (the step before it resolved: every guided row's
    previous token accepted); a no-op for a step launched with its sampling."""
    if step is None or step.launched.sampled:
        return
    step.launched.sample()
    if step.is_prefill:
        engine.prefill_launched(step.launched.seqs, step.launched)


def count_decode_rows(seqs: list[Sequence]) -> int:
    """Rows of a scheduled step that decode one token (the scheduler puts them first)."""
    return sum(s.num_scheduled_tokens == 1 and s.completes_in_step for s in seqs)


def schedule_next(engine, prev: PendingStep) -> PendingStep | None:
    """Launch the step after ``prev`` if nothing prevents it: without chunking a prefill of
    waiting sequences first, else a decode; with chunking whatever the scheduler mixes."""
    if not engine.overlap_enabled:
        return None
    sched = engine.scheduler
    if not sched.config.enable_chunked_prefill and sched.waiting:
        seqs = sched._schedule_prefill()
        if seqs:
            return launch(engine, seqs, True, prev)
    if not can_overlap(engine):
        return None
    ending = {s.seq_id for s, pos in zip(prev.seqs, prev.positions)
              if s.status == SequenceStatus.RUNNING
              and (s.prefill_only or sched.stop_reason_at(s, None, pos + 1) is not None)}
    seqs, is_prefill = sched.schedule(ending)
    return launch(engine, seqs, is_prefill, prev) if seqs else None


def resolve(engine, step: PendingStep, out) -> None:
    """Write the step's tokens into its sequences, finish those that stop (fills ``out``); then
    enqueue the deferred sampling of the step launched after it (``engine.pending``), whose
    token bitmask needed these tokens."""
    _write_tokens(engine, step, out)
    sample(engine, engine.pending)


def _write_tokens(engine, step: PendingStep, out) -> None:
    """Each sequence's token of ``step`` in place of its placeholder; stops found and finished."""
    token_ids, logprobs = step.launched.result()
    top = step.launched.top()
    bm, sched = engine.block_manager, engine.scheduler
    for i, (seq, pos) in enumerate(zip(step.seqs, step.positions)):
        if seq.status == SequenceStatus.FINISHED or pos >= seq.num_tokens:
            continue                                   # ended earlier: this token is dropped
        token = token_ids[i]
        seq.token_ids[pos] = token
        if pos == seq.num_tokens - 1:
            seq.last_token = token
        if logprobs is not None and seq.sampling_params.logprobs:
            seq.output_logprobs.append(logprobs[i])
        if (row_top := seq.top_of_row(top, i)) is not None:
            seq.output_top_logprobs.append(row_top)
        if seq.num_forks:
            fork.fork(engine, seq)
        out.seqs.append(seq)
        out.new_token_ids.append(token)
        reason = guide_stop.reason(seq) or sched.stop_reason_at(seq, token, pos + 1)
        if seq.prefill_only:                           # first token out: keep the blocks, stop
            engine.kv_handoff.hold(seq, reason)
            out.finished.append(seq)
        elif reason is not None:
            del seq.token_ids[pos + 1:]                # a speculative next placeholder, if any
            seq.last_token = token
            engine.finish(seq, reason)
            out.finished.append(seq)
        elif (pos + 1) % bm.block_size == 0 and pos + 1 < seq.num_tokens and seq.block_table:
            bm.register_block(seq, pos // bm.block_size)
