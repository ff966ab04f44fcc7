"""Prompt logprobs of a prefill step (SamplingParams.prompt_logprobs).

A sequence that asked for them and has no completion token yet (``Sequence.needs_prompt_logprobs``)
has every prompt position its step computes scored: position ``p`` < ``num_prompt_tokens - 1``
gives the logprob of prompt token ``p + 1`` (and, with ``top_logprobs``, that position's most
likely tokens). The block manager gives such a sequence no prefix-cache hit, so every position
is computed by some step. The values are written into ``Sequence.prompt_logprobs`` (indexed by
position, so chunks may resolve in any order; a recomputation writes the same values again) when
the step's tokens are read (``LaunchedStep.result``), before its first token is appended.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.common.engine.sequence import Sequence
from pdserve.common.layers.position_logprobs import position_logprobs


class PromptLogprobsPlan:
    """Which flat rows of a step are scored, against which target tokens, for which sequence."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.targets: list[int] = []
        self.owners: list[tuple[Sequence, int, int]] = []   # (seq, first position, count)
        self.k = 0

    @classmethod
    def of(cls, seqs: list[Sequence]) -> PromptLogprobsPlan | None:
        """The plan of a prefill step over ``seqs`` (its flat rows in order, each sequence's
        ``num_scheduled_tokens`` from its ``num_cached_tokens``); None when no row is scored."""
        plan, offset = cls(), 0
        for seq in seqs:
            start, n = seq.num_cached_tokens, seq.num_scheduled_tokens
            end = min(start + n, seq.num_prompt_tokens - 1)
            if seq.needs_prompt_logprobs and end > start:
                plan.rows.extend(range(offset, offset + end - start))
                plan.targets.extend(seq.token_ids[start + 1:end + 1])
                plan.owners.append((seq, start, end - start))
                plan.k = max(plan.k, seq.sampling_params.top_logprobs)
            offset += n
        return plan if plan.rows else None

    def launch(self, compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor
               ) -> PromptLogprobsStep:
        """Enqueue the scoring of the plan's rows of ``hidden`` [tokens, H] (all of the step's)."""
        device = hidden.device
        pin = device.type == "cuda"
        rows = torch.tensor(self.rows, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=pin)
        targets = torch.tensor(self.targets, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=pin)
        out = position_logprobs(compute_logits, hidden[rows], targets, self.k)
        return PromptLogprobsStep(self.owners, [to_host(t, pin) for t in (out.logprobs, out.top_token_ids,
                                                                       out.top_logprobs)])


class PromptLogprobsStep:
    """A step's prompt logprobs on their way to the host (pinned copies behind the step)."""

    def __init__(self, owners: list[tuple[Sequence, int, int]], host: list[torch.Tensor | None]) -> None:
        self.owners = owners
        self.host = host
        self.written = False

    def write(self) -> None:
        """Store the values in their sequences (once; after the step's event)."""
        if self.written:
            return
        self.written = True
        lp_t, ids_t, top_t = self.host
        assert lp_t is not None
        lps = lp_t.tolist()
        ids = ids_t.tolist() if ids_t is not None else None
        tops = top_t.tolist() if top_t is not None else None
        i = 0
        for seq, start, count in self.owners:
            k = seq.sampling_params.top_logprobs
            for j in range(count):
                top = (ids[i + j][:k], tops[i + j][:k]) if k and ids is not None and tops is not None else None
                seq.set_prompt_logprob(start + j, lps[i + j], top)
            i += count


def to_host(t: torch.Tensor | None, pin: bool) -> torch.Tensor | None:
    """A pinned host copy of ``t`` enqueued behind the step (``pin``: on CUDA), or ``t`` itself
    (CPU); the model runner's sampled tokens take the same way."""
    if t is None or not pin:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
