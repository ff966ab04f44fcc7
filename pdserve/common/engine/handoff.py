"""The engine's half of the KV handoff between workers (no gRPC, no transfer code).

Export (prefill worker): a request added with ``prefill_only`` leaves the batch after its first
token with its blocks kept (:meth:`KvHandoff.hold`) until :meth:`KvHandoff.release`, since a KV
send may read them until then. Import (decode worker): :meth:`KvHandoff.reserve` takes blocks
for a prompt whose KV arrives from elsewhere; :meth:`KvHandoff.admit` puts it in the decode batch
with its first token once the KV landed. ``LLMEngine.abort`` ends a held or reserved request too.
The first token comes from another worker (a PushKV field or the transfer's last message): admit
checks it against this engine's vocabulary before anything changes. One thread at a time: a
worker calls these under its engine's state lock (pdserve.common.serving.engine_loop), ``reserve``
possibly while a step computes (it takes only free blocks and cached full ones), ``admit`` and
``hold`` between steps.
"""
from __future__ import annotations

import math
from typing import Protocol

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.model_runner import ModelRunner
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.loader import ModelSource
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams


class HandoffEngine(Protocol):
    """What the handoff uses of its engine (``LLMEngine`` is one): the request table, the block
    pool, the batch, the runner's per-sequence state, and the engine's own entry and token paths."""

    source: ModelSource
    block_manager: BlockManager
    scheduler: Scheduler
    model_runner: ModelRunner
    requests: dict[str, Sequence]

    def new_sequence(self, prompt_token_ids: list[int], params: SamplingParams,
                     request_id: str | None) -> Sequence:
        """A validated sequence, entered in ``requests``."""
        ...

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs) -> list[Sequence]:
        """Append each sequence's token; the sequences that finished."""
        ...


class OutOfBlocks(RuntimeError):
    """The KV pool cannot hold the request now."""


class InvalidFirstToken(ValueError):
    """A first token from another worker that this engine cannot take (outside the vocabulary,
    or a NaN log-probability); nothing was changed."""


class KvHandoff:
    def __init__(self, engine: HandoffEngine) -> None:
        self.engine = engine
        self.held: dict[str, Sequence] = {}    # prefill-only, first token out, blocks kept

    # ---- import (decode side) -------------------------------------------------------------
    def reserve(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str) -> Sequence:
        """Blocks for a prompt whose KV arrives from elsewhere (reusing cached prefix blocks), not
        offered to the prefix cache until :meth:`admit`; raises OutOfBlocks if none fit now."""
        engine = self.engine
        seq = engine.new_sequence(prompt_token_ids, params, request_id)
        bm = engine.block_manager
        if not bm.can_allocate(seq):
            del engine.requests[seq.request_id]
            raise OutOfBlocks(f"{bm.num_blocks_needed(seq)} KV blocks needed, {bm.num_free_blocks} free")
        bm.allocate(seq, register=False)
        return seq

    def check_first_token(self, token_id: int, logprob: float | None) -> None:
        """Raise InvalidFirstToken unless ``token_id`` is in this engine's vocabulary and
        ``logprob`` is a number (or None)."""
        vocab = self.engine.source.config.vocab_size
        if not 0 <= token_id < vocab:
            raise InvalidFirstToken(f"first token id {token_id} is outside the vocabulary [0, {vocab})")
        if logprob is not None and math.isnan(logprob):
            raise InvalidFirstToken("first token log-probability is NaN")

    def admit(self, seq: Sequence, first_token_id: int, logprob: float | None) -> bool:
        """The prompt's KV has landed: append the first token and join the decode batch; False
        if that token already finished the request (blocks freed). Raises InvalidFirstToken
        (:meth:`check_first_token`) before any change: the caller still owns the blocks."""
        self.check_first_token(first_token_id, logprob)
        engine = self.engine
        seq.num_cached_tokens = seq.num_tokens
        engine.block_manager.register_blocks(seq)
        if engine.postprocess([seq], [first_token_id], [logprob] if seq.sampling_params.logprobs else None):
            return False
        engine.scheduler.add_running(seq)
        return True

    # ---- export (prefill side) ------------------------------------------------------------
    def hold(self, seq: Sequence, reason: FinishReason | None = None) -> None:
        """A prefill-only sequence after its first token: out of the batch, blocks kept (also
        when that token ends the request, ``reason``)."""
        engine = self.engine
        if seq in engine.scheduler.running:
            engine.scheduler.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        engine.requests.pop(seq.request_id, None)
        engine.model_runner.release(seq)
        self.held[seq.request_id] = seq

    def release(self, seq: Sequence) -> None:
        """Free the blocks a held sequence kept."""
        self.held.pop(seq.request_id, None)
        if seq.block_table:
            self.engine.block_manager.deallocate(seq)

    def release_id(self, request_id: str) -> Sequence | None:
        """Release the held sequence ``request_id``; None if there is none."""
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.release(seq)
        return seq
