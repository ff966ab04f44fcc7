"""Per-row token bitmasks: which tokens each row of a batch may sample (guided decoding).

A bitmask is ``[B, ceil(V / 32)]`` int32: bit ``j`` (least significant first) of word ``w`` of
row ``b`` set means token ``32 * w + j`` is allowed for row ``b`` (xgrammar's layout). A row
without a constraint is all ones (-1 words). Applied on the logits' device before any sampling
step, so greedy and random rows alike can only pick an allowed token; a row must allow at least
one token (the guides never build an empty row: a finished grammar allows its stop tokens).
"""
from __future__ import annotations

import torch

BITS = 32


def bitmask_words(vocab_size: int) -> int:
    """int32 words a row needs for ``vocab_size`` tokens."""
    return (vocab_size + BITS - 1) // BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, W]`` int32 -> ``[B, vocab_size]`` bool (True = allowed). Raises ValueError when the
    mask has too few words for ``vocab_size``."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be [B, W] int32, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] * BITS < vocab_size:
        raise ValueError(f"bitmask of {bitmask.shape[1]} words cannot cover {vocab_size} tokens")
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1          # arithmetic shift: bit 31 reads right too
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of ``logits`` [B, V] with every token the bitmask forbids at -inf (``logits`` is
    not modified: raw-logit logprobs still read it)."""
    if bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} rows of logits")
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf"))
