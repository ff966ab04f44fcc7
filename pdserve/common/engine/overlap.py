"""Overlapped steps: step N+1 is launched before the host has read step N's tokens (its
decode rows take their input token on the device), so the host prepares while the GPU runs.

Exactness: a launched sequence holds a PLACEHOLDER until its step resolves (in order); one that
stops on a token value is found a step late and its extra token dropped; a full block reaches
the prefix cache only once its tokens are known; no overlap with penalties (host history) or
guided sequences (a step's token bitmask needs the previous token accepted by the grammar).
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
            and not any(s.sampling_params.has_penalties or s.guide is not None for s in sched.running))


def launch(engine, seqs: list[Sequence], is_prefill: bool, prev: PendingStep | None) -> PendingStep:
    """Launch a step; decode rows that were in ``prev`` take their input token on the device."""
    src_rows = prev_tokens = None
    if prev is not None and prev.seqs:
        row = {s.seq_id: i for i, s in enumerate(prev.seqs)}
        src_rows = [row.get(s.seq_id, -1) for s in seqs]
        prev_tokens = prev.launched.token_ids
    computed = sum(s.num_scheduled_tokens for s in seqs)
    launched = engine.model_runner.launch(seqs, is_prefill, src_rows, prev_tokens)
    if is_prefill:
        engine.prefill_launched(launched.seqs, launched)
    positions = []
    for s in seqs:
        s.num_cached_tokens += s.num_scheduled_tokens
    for s in launched.seqs:
        positions.append(s.num_tokens)
        s.append_token(PLACEHOLDER)
    num_decode = count_decode_rows(seqs) if is_prefill else len(seqs)
    return PendingStep(launched.seqs, launched, positions, is_prefill, computed, num_decode)


def count_decode_rows(seqs: list[Sequence]) -> int:
    """Rows of a scheduled step that decode one token (the scheduler puts them first)."""
    return sum(s.num_scheduled_tokens == 1 and s.completes_in_step for s in seqs)


def schedule_next(engine, prev: PendingStep) -> PendingStep | None:
    """Launch the step after ``prev`` if nothing prevents it: without chunking a prefill of
    waiting sequences first, else a decode; with chunking whatever the scheduler mixes."""
    if not engine.overlap_enabled or any(s.guide is not None for s in prev.seqs):
        return None     # a guided sequence's next mask needs this step's token first
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
    """Write the step's tokens into its sequences, finish those that stop; fills ``out``."""
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
