"""A launched step: its forward enqueued on the device, its sampled tokens on their way to the host.

A step is normally launched with its sampling (one launch: forward, logits, sampler). A step with
guided rows launched while the previous step's tokens are still unread (an overlapped step,
engine/overlap.py) is launched *without* it: its forward and logits are enqueued, and the sampler
only once the host has accepted the previous tokens into the grammars and filled this step's
token bitmask (``sample``). Invariants: ``token_ids`` exists (on the device) once ``sampled``;
``result`` samples first if that was still pending; the host copies and the event are recorded
right behind the sampler, so reading the tokens waits for this step's sampling only.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.common.engine.prompt_logprobs import PromptLogprobsStep, to_host

if TYPE_CHECKING:
    from pdserve.common.engine.sequence import Sequence
    from pdserve.common.layers.sampler import SamplerOutput


class LaunchedStep:
    """A step's sampled tokens on their way to the host (pinned copy + event on CUDA).

    ``seqs``: the sampled sequences (row ``i`` of the tokens is ``seqs[i]``); ``sampler``: the
    deferred sampling (None: ``land`` is called by the launcher); ``kv_rows``: a prefill step,
    whose sequences' ``kv_ready`` becomes this step's event (a KV sender waits for it only)."""

    def __init__(self, device: torch.device, seqs: list[Sequence] | None = None,
                 prompt: PromptLogprobsStep | None = None,
                 sampler: Callable[[], SamplerOutput] | None = None, kv_rows: bool = False) -> None:
        self.seqs = seqs if seqs is not None else []
        self.device = device
        self.prompt = prompt                # the step's prompt logprobs, if any row asked
        self.kv_rows = kv_rows
        self._sampler = sampler
        self.token_ids: torch.Tensor | None = None    # [B] int64 on the device (feeds the next step)
        self.logprobs: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self._host_ids: torch.Tensor | None = None
        self._host_lp: torch.Tensor | None = None
        self._host_top_ids: torch.Tensor | None = None
        self._host_top_lp: torch.Tensor | None = None

    @property
    def sampled(self) -> bool:
        """Whether the step's sampling is enqueued (its ``token_ids`` exist)."""
        return self.token_ids is not None

    def sample(self) -> None:
        """Enqueue the deferred sampling (the caller made the token bitmask's inputs final: every
        guided row's previous token accepted); a no-op once sampled."""
        if self.sampled:
            return
        assert self._sampler is not None, "a step launched without its sampler"
        out, self._sampler = self._sampler(), None
        self.land(out.token_ids, out.logprobs, out.top_token_ids, out.top_logprobs)

    def land(self, token_ids: torch.Tensor, logprobs: torch.Tensor | None = None,
             top_token_ids: torch.Tensor | None = None, top_logprobs: torch.Tensor | None = None) -> None:
        """Record the sampler's outputs and start their copy to the host."""
        cuda = self.device.type == "cuda"
        self.token_ids, self.logprobs = token_ids, logprobs
        self._host_ids = to_host(token_ids, cuda)
        self._host_lp = to_host(logprobs, cuda)
        self._host_top_ids = to_host(top_token_ids, cuda)
        self._host_top_lp = to_host(top_logprobs, cuda)
        if cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        if self.kv_rows:
            for seq in self.seqs:
                seq.kv_ready = self.event

    def result(self) -> tuple[list[int], list[float] | None]:
        """The tokens and their logprobs (sampling first if still deferred); also stores the
        step's prompt logprobs in their sequences (engine/prompt_logprobs.py)."""
        self.sample()
        if self.event is not None:
            self.event.synchronize()
        if self.prompt is not None:
            self.prompt.write()
        assert self._host_ids is not None
        return self._host_ids.tolist(), (self._host_lp.tolist() if self._host_lp is not None else None)

    def top(self) -> tuple[list[list[int]], list[list[float]]] | None:
        """Per row, the most likely tokens' ids and raw logprobs (the batch's largest
        ``top_logprobs`` of them, most likely first); None when no row asked. After ``result``."""
        if self._host_top_ids is None or self._host_top_lp is None:
            return None
        return self._host_top_ids.tolist(), self._host_top_lp.tolist()
