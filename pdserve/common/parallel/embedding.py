"""Vocabulary-parallel embedding and LM head: rank r holds vocabulary rows ``[start, end)`` in a
shard of ``ceil(vocab / size)`` rows (zero padded). The embedding looks up the ids it holds
(zeros for the others) and all-reduces; the LM head computes its shard's logits and all-gathers
them (the padding columns cut off). At one rank: ``F.embedding`` and ``F.linear`` exactly."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .group import RankGroup, tp_rank, tp_size
from .sharding import vocab_shard


class VocabParallelEmbedding(nn.Embedding):
    """An ``nn.Embedding`` of this rank's shard (``num_embeddings``: its rows, padding
    included; ``vocab_size``: the whole vocabulary's)."""

    def __init__(self, vocab_size: int, embedding_dim: int, group: RankGroup | None = None) -> None:
        self.start, self.end, rows = vocab_shard(vocab_size, tp_size(group), tp_rank(group))
        super().__init__(rows, embedding_dim)
        self.vocab_size = vocab_size
        self.group = group if tp_size(group) > 1 else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [T] -> [T, H]."""
        if self.group is None:
            return F.embedding(input_ids, self.weight)
        held = (input_ids >= self.start) & (input_ids < self.end)
        out = F.embedding((input_ids - self.start) * held, self.weight)
        out.mul_(held.unsqueeze(-1).to(out.dtype))
        return self.group.all_reduce(out)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.vocab_size, self.embedding_dim)

    def load_shard(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        if tuple(tensor.shape) != self.full_shape(name):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != {self.full_shape(name)}")
        n = self.end - self.start
        with torch.no_grad():
            self.weight[:n].copy_(tensor[self.start:self.end])
            self.weight[n:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """``forward(hidden)`` -> logits over the whole vocabulary; tie it to the embedding by
    assigning the embedding's ``weight`` (the shards match)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] -> logits [B, V]."""
        logits = F.linear(hidden, self.weight)
        if self.group is None:
            return logits
        return self.group.all_gather_last(logits)[..., :self.vocab_size]
