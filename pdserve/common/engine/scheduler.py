"""Continuous batching: which sequences run in the next engine step, and how many tokens each.

Chunked prefill (default), one token budget per step: decode rows (out of blocks: preempt the
newest running sequence), then next chunks of partial prompts, then waiting ones FCFS (none in
a step that preempted). A prompt's blocks are all taken at admission, so it never preempts
mid-way; a chunk's full blocks reach the prefix cache only once that chunk is scheduled.
Without chunking a step is all prefill or all decode.

A step with decode rows has the smaller ``mixed_budget`` (``max_mixed_batched_tokens``, where
set), and ``prompt_budget`` (the engine's TPOT guard, engine/tpot_guard.py) may cap its prompt
tokens further; a step without decode rows keeps the whole budget, so a worker that is not
decoding prefills in prefill-sized steps while its decode rows, when it has some, see short ones.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.config import check_mixed_budget, check_step_limits
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.outputs import FinishReason


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    enable_chunked_prefill: bool = True
    max_num_partial_prefills: int = 1       # prompts that may be partly prefilled at once
    long_prefill_token_threshold: int = 0   # cap on one prompt's chunk per step; 0 = no cap
    max_mixed_batched_tokens: int = 0       # budget of a step with decode rows; 0 = max_num_batched_tokens

    def __post_init__(self) -> None:
        check_step_limits(self.max_num_seqs, self.max_num_batched_tokens, self.max_num_partial_prefills,
                          self.long_prefill_token_threshold)
        check_mixed_budget(self.max_mixed_batched_tokens, self.max_num_batched_tokens)
        if self.enable_chunked_prefill:
            for name in ("max_num_batched_tokens", "max_mixed_batched_tokens"):
                if 0 < getattr(self, name) < self.max_num_seqs:
                    raise ValueError(f"{name} ({getattr(self, name)}) must be >= max_num_seqs "
                                     f"({self.max_num_seqs}) so that every running sequence can decode in one step")
        elif self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({self.max_model_len}) so that any prompt fits one step "
                             "(or enable chunked prefill)")

    @property
    def chunk_cap(self) -> int:
        return self.long_prefill_token_threshold or self.max_num_batched_tokens

    @property
    def mixed_budget(self) -> int:
        """Tokens (decode rows + prompt tokens) of a step with decode rows."""
        return self.max_mixed_batched_tokens or self.max_num_batched_tokens


def num_remaining_tokens(seq: Sequence) -> int:
    """Tokens of ``seq`` whose KV is not computed yet (1 for a decoding sequence)."""
    return seq.num_tokens - seq.num_cached_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        # (decode rows, token budget left) -> prompt tokens the step may carry; None = the budget
        self.prompt_budget: Callable[[list[Sequence], int], int] | None = None

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

    def num_waiting_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: waiting sequences and unfinished chunked prompts."""
        waiting = sum(s.num_tokens - s.num_cached_tokens for s in self.waiting)
        return waiting + sum(max(num_remaining_tokens(s) - 1, 0) for s in self.running)

    def schedule(self, exclude: set[int] | None = None) -> tuple[list[Sequence], bool]:
        """The sequences of the next step (decode rows first) and whether any computes prompt
        tokens. ``exclude``: running seq ids that get no decode row this step."""
        if self.config.enable_chunked_prefill:
            return self._schedule_chunked(exclude)
        scheduled = self._schedule_prefill()
        if scheduled:
            return scheduled, True
        return self._schedule_decode(exclude), False

    def _schedule_chunked(self, exclude: set[int] | None) -> tuple[list[Sequence], bool]:
        budget = self.config.max_num_batched_tokens
        num_preempted = self.num_preemptions
        partial: list[Sequence] = []
        decode = self._schedule_decode(exclude, budget, partial)
        if decode:
            budget = min(budget, self.config.mixed_budget)
        budget -= len(decode)
        if self.prompt_budget is not None and decode:
            budget = min(budget, self.prompt_budget(decode, budget))
        chunks = self._schedule_running_chunks(partial, budget, len(decode))
        budget -= sum(s.num_scheduled_tokens for s in chunks)
        if self.num_preemptions == num_preempted and self.waiting:
            num_partial = sum(num_remaining_tokens(s) > s.num_scheduled_tokens for s in chunks) \
                + len(partial) - len(chunks)
            chunks += self._admit_waiting(budget, len(decode) + len(chunks), num_partial)
        return decode + chunks, bool(chunks)

    def _schedule_running_chunks(self, partial: list[Sequence], budget: int, num_rows: int) -> list[Sequence]:
        """The next chunk of each partly prefilled running sequence (``partial``), oldest first."""
        chunks: list[Sequence] = []
        for seq in partial:
            if budget <= 0 or num_rows + len(chunks) >= self.config.max_num_seqs:
                break
            self._schedule_chunk(seq, budget)
            budget -= seq.num_scheduled_tokens
            chunks.append(seq)
        return chunks

    def rows_owed(self) -> int:
        """Decode rows the running sequences will take: each one, and the samples those that
        have not forked yet will fork into."""
        return len(self.running) + sum(s.num_forks for s in self.running)

    def _admit_waiting(self, budget: int, num_rows: int, num_partial: int) -> list[Sequence]:
        """Waiting sequences, first come first served, as whole prompts or a first chunk."""
        admitted: list[Sequence] = []
        max_rows = self.config.max_num_seqs
        while self.waiting and budget > 0 and len(self.running) < max_rows and num_rows + len(admitted) < max_rows:
            seq = self.waiting[0]
            if self.rows_owed() + 1 + seq.num_forks > max_rows:
                break                       # its samples would not fit the batch once forked
            remaining = seq.num_tokens - self.block_manager.prefix_hit_tokens(seq)
            if min(remaining, budget, self.config.chunk_cap) < remaining:
                if num_partial >= self.config.max_num_partial_prefills:
                    break
                num_partial += 1
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq, register=False)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule_chunk(seq, budget)
            budget -= seq.num_scheduled_tokens
            admitted.append(seq)
        return admitted

    def _schedule_chunk(self, seq: Sequence, budget: int) -> None:
        """Give ``seq`` its next chunk and offer the blocks the chunk completes to the cache."""
        n = min(num_remaining_tokens(seq), budget, self.config.chunk_cap)
        seq.num_scheduled_tokens = n
        self.block_manager.register_blocks(seq, seq.num_cached_tokens + n)

    def _schedule_prefill(self) -> list[Sequence]:
        scheduled: list[Sequence] = []
        num_tokens = 0
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.rows_owed() + 1 + seq.num_forks > self.config.max_num_seqs:
                break
            if num_tokens + seq.num_tokens > self.config.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                break
            self.block_manager.allocate(seq)
            seq.num_scheduled_tokens = seq.num_tokens - seq.num_cached_tokens
            num_tokens += seq.num_scheduled_tokens
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
        return scheduled

    def _schedule_decode(self, exclude: set[int] | None = None, budget: int | None = None,
                         partial: list[Sequence] | None = None) -> list[Sequence]:
        """One token for each running sequence whose prompt is done (``exclude``: seq ids to
        leave out this step), preempting the newest running sequences when blocks run out.
        ``partial`` (if given) receives the running sequences still prefilling, in order."""
        limit = self.config.max_num_seqs if budget is None else min(budget, self.config.max_num_seqs)
        if exclude:
            excluded = [s for s in self.running if s.seq_id in exclude]
            running = [s for s in self.running if s.seq_id not in exclude]
        else:
            excluded, running = [], list(self.running)
        scheduled: list[Sequence] = []
        bs = self.block_manager.block_size
        i = 0
        while i < len(running) and len(scheduled) < limit:
            seq = running[i]
            i += 1
            n = seq.num_tokens
            if n - seq.num_cached_tokens != 1:
                if partial is not None:
                    partial.append(seq)     # a prompt still being prefilled
                continue
            if (n - 1) % bs and n % bs:
                seq.num_scheduled_tokens = 1  # the newest token neither starts nor fills a block
                scheduled.append(seq)
                continue
            while not self.block_manager.can_append(seq) and running[-1] is not seq:
                self.preempt(running.pop())
            if self.block_manager.can_append(seq):
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                scheduled.append(seq)
            else:
                self.preempt(running.pop())   # seq itself: nothing else left to free
        if partial is not None:
            partial.extend(s for s in running[i:] if s.num_tokens - s.num_cached_tokens > 1)
        self.running = deque(running + excluded) if excluded else deque(running)
        # Longest context first: the decode kernel starts programs in row order, so a ragged batch
        # ends with short work (chosen by measurement: bench/NOTES.md). Stable sort.
        scheduled.sort(key=_num_tokens, reverse=True)
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks and put it first in line for recompute."""
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        seq.num_scheduled_tokens = 0
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
