"""Additive per-row logit edits: OpenAI's ``logit_bias`` and the ``min_tokens`` ban on stop ids.

Both are a sparse list of (row, token, value) entries, built on the host once per step and
added to the ``[B, V]`` logits on the device in one ``index_add`` (no host sync). A row with
fewer than ``min_tokens`` completion tokens gets ``-inf`` at every id that would stop it (the
EOS ids unless ``ignore_eos``, and its ``stop_token_ids``), so it cannot sample them; -inf plus a
bias stays -inf. Token ids at or beyond the logits' width are skipped (the router refuses them
earlier with the vocabulary's size).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pdserve.common.sampling_params import SamplingParams

_NEG_INF = float("-inf")


class BiasedSequence(Protocol):
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def num_completion_tokens(self) -> int: ...


@dataclass
class LogitBias:
    """``index`` [N] int64 (``row * V + token``) and ``values`` [N] fp32, on the device.
    ``per_step``: some row's entries depend on its completion length (min_tokens), so the
    entries must be rebuilt every step."""

    index: torch.Tensor
    values: torch.Tensor
    per_step: bool


def stop_ids(sp: SamplingParams, eos_token_ids: Iterable[int]) -> list[int]:
    """The ids that end a sequence with ``sp``: its stop_token_ids, plus EOS unless ignore_eos."""
    ids = list(sp.stop_token_ids)
    if not sp.ignore_eos:
        ids += [t for t in eos_token_ids if t not in ids]
    return ids


def build_logit_bias(seqs: Sequence[BiasedSequence], vocab_size: int, device: torch.device,
                     eos_token_ids: Sequence[int] = ()) -> LogitBias | None:
    """The batch's entries (row ``i`` is ``seqs[i]``), or None when no row has any."""
    index: list[int] = []
    values: list[float] = []
    per_step = False
    for row, seq in enumerate(seqs):
        sp = seq.sampling_params
        base = row * vocab_size
        for token, bias in sp.logit_bias:
            if token < vocab_size:
                index.append(base + token)
                values.append(bias)
        if sp.min_tokens:
            per_step = True
            if seq.num_completion_tokens < sp.min_tokens:
                for token in stop_ids(sp, eos_token_ids):
                    if token < vocab_size:
                        index.append(base + token)
                        values.append(_NEG_INF)
    if not index:
        return None if not per_step else LogitBias(torch.empty(0, dtype=torch.int64, device=device),
                                                   torch.empty(0, dtype=torch.float32, device=device), True)
    pin = device.type == "cuda"
    idx = torch.tensor(index, dtype=torch.int64, pin_memory=pin).to(device, non_blocking=pin)
    val = torch.tensor(values, dtype=torch.float32, pin_memory=pin).to(device, non_blocking=pin)
    return LogitBias(idx, val, per_step)


def apply_logit_bias(x: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """A new ``[B, V]`` tensor: ``x`` with the entries added (``x`` itself is not modified)."""
    if bias.index.numel() == 0:
        return x
    return x.reshape(-1).index_add(0, bias.index, bias.values.to(x.dtype)).view(x.shape)
