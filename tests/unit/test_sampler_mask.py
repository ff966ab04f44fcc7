"""The sampler's masked path (per-row token bitmask, greedy and random) and its logprob path
(chosen token and top-k), each against a plain torch reference on fresh random logits (CPU)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sampler_cases import CPU, make_seq

from pdserve.common.layers.sampler import Sampler, SamplerOutput, prepare_sampling
from pdserve.common.layers.token_mask import apply_token_bitmask, bitmask_words, unpack_bitmask
from pdserve.common.sampling_params import SamplingParams


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """Reference packing of a [B, V] bool mask into [B, ceil(V/32)] int32 words (bit j of word w
    = token 32w + j), one bit at a time."""
    B, V = allowed.shape
    words = np.zeros((B, bitmask_words(V)), dtype=np.uint32)
    for b in range(B):
        for t in np.flatnonzero(allowed[b].numpy()):
            words[b, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    return torch.from_numpy(words.view(np.int32))


def random_allowed(B: int, V: int, gen: torch.Generator, p: float = 0.1) -> torch.Tensor:
    """[B, V] bool with about ``p`` of the tokens allowed, at least one per row."""
    allowed = torch.rand(B, V, generator=gen) < p
    allowed[torch.arange(B), torch.randint(0, V, (B,), generator=gen)] = True
    return allowed


def step(params: list[SamplingParams], logits: torch.Tensor, bitmask: torch.Tensor | None,
         gens: dict | None = None) -> tuple[SamplerOutput, list]:
    seqs = [make_seq(sp) for sp in params]
    batch = prepare_sampling(seqs, logits.shape[1], CPU, {} if gens is None else gens)
    batch = dataclasses.replace(batch, token_bitmask=bitmask)
    return Sampler()(logits, batch), seqs


@pytest.mark.parametrize("V", [1, 31, 32, 33, 1000, 4099])
def test_unpack_matches_the_reference_packing(V):
    gen = torch.Generator().manual_seed(V)
    allowed = torch.rand(5, V, generator=gen) < 0.5
    allowed[:, -1] = True                       # the last token: bit 31 (sign bit) when V % 32 == 0
    assert torch.equal(unpack_bitmask(pack(allowed), V), allowed)


def test_unpack_refuses_a_mask_too_narrow_or_not_int32():
    with pytest.raises(ValueError, match="cannot cover"):
        unpack_bitmask(torch.full((1, 2), -1, dtype=torch.int32), 65)
    with pytest.raises(ValueError, match="int32"):
        unpack_bitmask(torch.full((1, 2), -1, dtype=torch.int64), 64)
    with pytest.raises(ValueError, match="rows"):
        apply_token_bitmask(torch.zeros(3, 64), torch.full((2, 2), -1, dtype=torch.int32))


@pytest.mark.parametrize("logprobs", [False, True])       # the argmax fast path and the fp32 path
def test_greedy_takes_the_best_allowed_token(logprobs):
    gen = torch.Generator().manual_seed(1)
    B, V = 16, 3000
    logits = torch.randn(B, V, generator=gen)
    allowed = random_allowed(B, V, gen)
    allowed[3] = True                           # an unconstrained row inside a guided batch
    out, _ = step([SamplingParams(temperature=0.0, logprobs=logprobs)] * B, logits, pack(allowed))
    expected = logits.masked_fill(~allowed, float("-inf")).argmax(dim=-1)
    assert torch.equal(out.token_ids, expected)
    assert allowed[torch.arange(B), out.token_ids].all()


def test_no_mask_is_the_unmasked_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(8, 500, generator=gen)
    out, _ = step([SamplingParams(temperature=0.0)] * 8, logits, None)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.05},
                                   {"repetition_penalty": 1.3, "presence_penalty": 0.5}])
def test_random_rows_sample_only_allowed_tokens(extra):
    gen = torch.Generator().manual_seed(3)
    B, V = 64, 2000
    torch.manual_seed(0)
    for _ in range(5):                          # fresh logits and masks every round
        logits = torch.randn(B, V, generator=gen) * 3
        allowed = random_allowed(B, V, gen, p=0.02)
        params = [SamplingParams(temperature=0.8, **extra)] * (B // 2) + [SamplingParams(temperature=0.0)] * (B // 2)
        out, _ = step(params, logits, pack(allowed))
        assert allowed[torch.arange(B), out.token_ids].all()


def test_random_rows_follow_the_masked_distribution():
    """Many draws of one masked row: frequencies match softmax over the allowed tokens only."""
    gen = torch.Generator().manual_seed(4)
    V, n = 50, 20000
    row = torch.randn(V, generator=gen)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[1, 7, 8, 20, 49]] = True
    logits = row.unsqueeze(0).expand(n, -1).contiguous()
    torch.manual_seed(5)
    out, _ = step([SamplingParams(temperature=1.0)] * n, logits, pack(allowed.unsqueeze(0).expand(n, -1)))
    freq = torch.bincount(out.token_ids, minlength=V).float() / n
    expected = torch.softmax(row.masked_fill(~allowed, float("-inf")), dim=-1)
    assert freq[~allowed].sum() == 0
    assert (freq - expected).abs().max() < 0.015


def test_seeded_masked_rows_repeat():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(4, 800, generator=gen)
    mask = pack(random_allowed(4, 800, gen, p=0.2))
    a, _ = step([SamplingParams(temperature=1.0, seed=11)] * 4, logits, mask)
    b, _ = step([SamplingParams(temperature=1.0, seed=11)] * 4, logits, mask)
    assert torch.equal(a.token_ids, b.token_ids)


def test_logprobs_are_the_raw_distribution_even_when_masked():
    """The chosen token's logprob and the top-k are log_softmax of the raw logits (not masked,
    not penalised, not tempered), top-k sorted most likely first, each row cut to its own k."""
    gen = torch.Generator().manual_seed(7)
    B, V = 6, 1500
    logits = torch.randn(B, V, generator=gen) * 2
    ks = [0, 1, 5, 20, 3, 0]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.7, logprobs=True, top_logprobs=k,
                             presence_penalty=0.5 if i == 4 else 0.0) for i, k in enumerate(ks)]
    allowed = random_allowed(B, V, gen, p=0.3)
    torch.manual_seed(8)
    out, seqs = step(params, logits, pack(allowed))
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
    assert out.top_token_ids.shape == (B, max(ks))
    torch.testing.assert_close(out.logprobs.double(), ref.gather(1, out.token_ids.unsqueeze(1)).squeeze(1),
                               atol=1e-5, rtol=0)
    top = (out.top_token_ids.tolist(), out.top_logprobs.tolist())
    for i, (seq, k) in enumerate(zip(seqs, ks)):
        got = seq.top_of_row(top, i)
        if k == 0:
            assert got is None
            continue
        ref_vals, ref_ids = ref[i].topk(k)
        assert got[0] == ref_ids.tolist()
        assert got[1] == pytest.approx(ref_vals.tolist(), abs=1e-5)


def test_top_logprobs_need_logprobs_and_stay_in_range():
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=2)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(logprobs=True, top_logprobs=21)
