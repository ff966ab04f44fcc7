"""Sampler test helpers: sequences with given sampling parameters, one sampler step over given
logits, many independent draws from one distribution (CPU)."""
from __future__ import annotations

from collections.abc import Iterable

import torch

from pdserve.common.engine.sequence import Sequence
from pdserve.common.layers.sampler import Sampler, SamplerOutput, prepare_sampling
from pdserve.common.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK = 16


def make_seq(sp: SamplingParams, prompt: Iterable[int] = (1, 2, 3), completion: Iterable[int] = ()) -> Sequence:
    seq = Sequence(list(prompt), sp, BLOCK)
    for t in completion:
        seq.append_token(t)
    return seq


def run(seqs: list[Sequence], logits: torch.Tensor,
        generators: dict[int, torch.Generator] | None = None) -> SamplerOutput:
    gens = {} if generators is None else generators
    batch = prepare_sampling(seqs, logits.shape[1], CPU, gens)
    return Sampler()(logits, batch)


def sample_many(sp: SamplingParams, logits_row: torch.Tensor, n: int,
                seed: int = 0) -> torch.Tensor:
    """n independent draws for one distribution, as one batch of n identical rows."""
    torch.manual_seed(seed)
    seqs = [make_seq(sp) for _ in range(n)]
    out = run(seqs, logits_row.unsqueeze(0).expand(n, -1).contiguous())
    return out.token_ids
