"""Continuous batching: which sequences run in the next engine step.

A step is either a prefill step (new or preempted sequences, up to ``max_num_batched_tokens``
tokens to compute and ``max_num_seqs`` sequences) or a decode step (one token for each running
sequence). Prefill goes first whenever something waits and fits. When a decode step needs a
new block and none is free, the newest running sequence is preempted: its blocks are released
and it goes back to the front of the waiting queue, to be recomputed (its full blocks usually
still sit in the prefix cache, so the recompute is mostly cache hits).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from common.engine.block_manager import BlockManager
from common.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) so that any prompt fits one step")


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose KV must be computed here (a new request or a recompute)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join the decode batch with KV already in place (imported from a prefill worker)."""
        assert seq.block_table and seq.num_cached_tokens == seq.num_tokens - 1, seq
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The sequences of the next step and whether it is a prefill step."""
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(), False

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if num_tokens + seq.num_tokens > self.config.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            num_tokens += seq.num_tokens - seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self, exclude: set[int] | None = None) -> list[Sequence]:
        """One token for each running sequence (``exclude``: seq ids to leave out this step)."""
        scheduled: list[Sequence] = []
        skipped: list[Sequence] = []
        while self.running and len(scheduled) < self.config.max_num_seqs:
            seq = self.running.popleft()
            if exclude and seq.seq_id in exclude:
                skipped.append(seq)
                continue
            n = seq.num_tokens
            if (n - 1) % self.block_manager.block_size and n % self.block_manager.block_size:
                scheduled.append(seq)       # the newest token neither starts nor fills a block
                continue
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled + skipped))
        # Rows longest context first: the decode attention kernel starts its programs in row
        # order, so the longest sequences start first and a ragged batch ends with short work
        # (bench/attention_balance.py: 3-4% less attention time at batch 192-256). Stable, so
        # the order only changes when the batch membership does.
        scheduled.sort(key=_num_tokens, reverse=True)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and put it first in line for recompute."""
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def stop_reason(self, seq: Sequence) -> FinishReason | None:
        return self.stop_reason_at(seq, seq.last_token, seq.num_tokens)

    def stop_reason_at(self, seq: Sequence, token_id: int | None, num_tokens: int) -> FinishReason | None:
        """Why ``seq`` stops once it holds ``num_tokens`` tokens, the last being ``token_id``
        (None: the value is not known yet, check the length only)."""
        params = seq.sampling_params
        if token_id is not None:
            if not params.ignore_eos and token_id in self.config.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish ``seq`` wherever it is and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(reason)
        if seq.block_table:
            self.block_manager.deallocate(seq)


def _num_tokens(seq: Sequence) -> int:
    return seq.num_tokens
