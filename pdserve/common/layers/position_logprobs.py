"""Log-probabilities of given tokens at given positions of a forward (prompt logprobs).

For hidden states ``hidden`` [N, H] (one row per position) and the token that follows each
position, ``targets`` [N]: each target's logprob under the raw logits' ``log_softmax`` in fp32
and, when ``k`` > 0, the position's ``k`` most likely tokens and their logprobs (most likely
first; ``torch.topk`` order on ties). The logits are made ``chunk_rows`` positions at a time, so
a long prompt never holds ``N x V`` fp32 logits at once; everything stays on the device.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

CHUNK_ROWS = 256


@dataclass
class PositionLogprobs:
    logprobs: torch.Tensor                  # [N] fp32
    top_token_ids: torch.Tensor | None      # [N, k] int64 (k > 0)
    top_logprobs: torch.Tensor | None       # [N, k] fp32


def position_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                      targets: torch.Tensor, k: int = 0, chunk_rows: int = CHUNK_ROWS) -> PositionLogprobs:
    """See the module docstring; ``compute_logits`` maps [n, H] hidden rows to [n, V] logits."""
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"{hidden.shape[0]} positions for {targets.shape[0]} targets")
    lps, ids, tops = [], [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        logits = compute_logits(hidden[start:start + chunk_rows]).float()
        lse = torch.logsumexp(logits, dim=-1)
        tgt = targets[start:start + chunk_rows].unsqueeze(1)
        lps.append(logits.gather(1, tgt).squeeze(1) - lse)
        if k:
            top = logits.topk(k, dim=-1)
            ids.append(top.indices)
            tops.append(top.values - lse.unsqueeze(1))
    if not lps:
        empty = hidden.new_empty(0, dtype=torch.float32)
        return PositionLogprobs(empty, hidden.new_empty(0, k, dtype=torch.int64) if k else None,
                                hidden.new_empty(0, k, dtype=torch.float32) if k else None)
    return PositionLogprobs(torch.cat(lps), torch.cat(ids) if k else None, torch.cat(tops) if k else None)
