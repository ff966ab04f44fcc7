"""Megatron-style linear layers. A column-parallel layer holds its rank's rows of the weight (its
output stays split over the ranks, no communication); a row-parallel layer holds its rank's
columns and sums the partial outputs with one all-reduce (its bias added once, after the sum).
At one rank both are ``nn.Linear`` exactly (same parameters, same forward).

Loading: ``full_shape(name)`` is the parameter's shape at one rank; ``load_shard(name, tensor,
part)`` copies this rank's slice of a full tensor: a checkpoint's tensor of one part (``part``:
q/k/v or gate/up of a merged layer) or the whole merged tensor (``part`` None, the one-rank
layout: seeded dummy weights give every rank its slice of the same full weights)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .group import RankGroup


def _check(name: str, got: Sequence[int], want: Sequence[int]) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{name}: shape {tuple(got)} != {tuple(want)}")


class ColumnParallelLinear(nn.Linear):
    """``parts``: the full output sizes of the matmuls merged into this one (qkv: [q, k, v];
    gate_up: [i, i]; one part for a plain layer); ``ranges``: this rank's ``[start, end)`` rows of
    each part. The local output is the parts' slices, concatenated in part order."""

    def __init__(self, in_features: int, parts: Sequence[int], ranges: Sequence[tuple[int, int]], bias: bool,
                 group: RankGroup | None = None) -> None:
        if len(parts) != len(ranges):
            raise ValueError("one range a part")
        super().__init__(in_features, sum(e - s for s, e in ranges), bias=bias)
        self.parts = tuple(parts)
        self.ranges = tuple(ranges)
        self.group = group

    def full_shape(self, name: str) -> tuple[int, ...]:
        rows = sum(self.parts)
        return (rows, self.in_features) if name == "weight" else (rows,)

    def load_shard(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        param = getattr(self, name)
        if part is None:
            _check(name, tensor.shape, self.full_shape(name))
            pieces = dict(enumerate(tensor.split(self.parts, 0)))
        else:
            pieces = {part: tensor}
        with torch.no_grad():
            for i, piece in pieces.items():
                _check(f"{name} part {i}", piece.shape, (self.parts[i], *param.shape[1:]))
                start, end = self.ranges[i]
                offset = sum(e - s for s, e in self.ranges[:i])
                param.narrow(0, offset, end - start).copy_(piece.narrow(0, start, end - start))


class RowParallelLinear(nn.Linear):
    """Input columns ``in_range`` of a ``[out_features, in_features]`` weight; the output is the
    all-reduced sum over the ranks (then the bias)."""

    def __init__(self, in_features: int, out_features: int, in_range: tuple[int, int], bias: bool,
                 group: RankGroup | None = None) -> None:
        super().__init__(in_range[1] - in_range[0], out_features, bias=bias)
        self.full_in_features = in_features
        self.in_range = in_range
        self.group = group if group is not None and group.size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return F.linear(x, self.weight, self.bias)
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.out_features, self.full_in_features) if name == "weight" else (self.out_features,)

    def load_shard(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        _check(name, tensor.shape, self.full_shape(name))
        param = getattr(self, name)
        with torch.no_grad():
            if name == "weight":
                start, end = self.in_range
                param.copy_(tensor[:, start:end])
            else:
                param.copy_(tensor)
