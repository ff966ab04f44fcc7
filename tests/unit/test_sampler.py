"""Sampler: batch preparation, greedy, temperature, top-k/top-p/min-p and the sampled
distributions (CPU). Seeds, penalties, logprobs, mixed batches: test_sampler_seeds.py."""
from __future__ import annotations

import pytest
import torch
from sampler_cases import CPU, make_seq, run, sample_many

from pdserve.common.layers.sampler import SamplingBatch, prepare_sampling
from pdserve.common.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- prepare_sampling

def test_prepare_sampling_fields_and_flags():
    V = 10
    seqs = [make_seq(SamplingParams(temperature=0.0)),
            make_seq(SamplingParams(temperature=0.7, top_k=3, top_p=0.9, seed=5)),
            make_seq(SamplingParams(top_k=-1, min_p=0.1, logprobs=True)),
            make_seq(SamplingParams(top_k=0)),
            make_seq(SamplingParams(top_k=50))]
    gens: dict[int, torch.Generator] = {}
    b = prepare_sampling(seqs, V, CPU, gens)
    assert isinstance(b, SamplingBatch) and b.batch_size == 5
    assert b.temperatures.dtype == torch.float32 and b.top_ks.dtype == torch.int64
    assert b.temperatures.tolist() == pytest.approx([0.0, 0.7, 1.0, 1.0, 1.0])
    assert b.top_ks.tolist() == [V, 3, V, V, V]       # -1, 0 and >= V all mean off
    assert b.top_ps.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0, 1.0])
    assert b.min_ps.tolist() == pytest.approx([0.0, 0.0, 0.1, 0.0, 0.0])
    assert not b.all_greedy and b.any_greedy
    assert b.any_top_k and b.any_top_p and b.any_min_p and b.need_logprobs
    assert not b.any_penalty and b.output_counts is None and b.prompt_mask is None
    assert b.max_top_k == 3 and b.sort_k == V
    # one generator, for the seeded sampled row, stored by seq_id
    assert list(gens) == [seqs[1].seq_id]
    assert b.generators[1] is gens[seqs[1].seq_id]
    assert [g is None for g in b.generators] == [True, False, True, True, True]
    assert b.seeded_rows == [1]
    # the same generator object is reused on the next step
    b2 = prepare_sampling(seqs, V, CPU, gens)
    assert b2.generators[1] is b.generators[1]


def test_prepare_sampling_greedy_only_and_penalty_tensors():
    V = 8
    seqs = [make_seq(SamplingParams(temperature=0.0, seed=3)),   # seed is moot for greedy
            make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
                     prompt=(1, 1, 2), completion=(5, 5, 6)),
            make_seq(SamplingParams(temperature=0.0), prompt=(7,), completion=(7, 7))]
    gens: dict[int, torch.Generator] = {}
    b = prepare_sampling(seqs, V, CPU, gens)
    assert gens == {} and b.all_greedy
    assert not (b.any_top_k or b.any_top_p or b.any_min_p or b.need_logprobs)
    assert b.any_penalty and b.any_repetition_penalty and b.any_additive_penalty
    assert b.output_counts.shape == (3, V) and b.prompt_mask.shape == (3, V)
    assert b.output_counts[1].tolist() == [0, 0, 0, 0, 0, 2, 1, 0]
    assert b.prompt_mask[1].tolist() == [False, True, True, False, False, False, False, False]
    # rows without penalties carry nothing
    assert b.output_counts[2].sum().item() == 0 and not b.prompt_mask[2].any()


# ----------------------------------------------------------------------------- greedy / filters

def test_greedy_is_argmax_and_ties_lowest_index():
    torch.manual_seed(0)
    logits = torch.randn(6, 40)
    logits[5, 3] = logits[5, 17] = logits[5].max() + 1.0
    seqs = [make_seq(SamplingParams(temperature=0.0)) for _ in range(6)]
    out = run(seqs, logits)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[5].item() == 3
    assert out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_any_dtype_and_input_untouched(dtype):
    torch.manual_seed(1)
    logits = torch.randn(4, 33).to(dtype)
    before = logits.clone()
    seqs = [make_seq(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=True),
                     completion=(0,)) for _ in range(4)]
    run(seqs, logits)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("sp", [
    SamplingParams(top_k=1),
    SamplingParams(top_k=1, temperature=5.0),
    SamplingParams(top_p=1e-6),
    SamplingParams(top_p=1e-6, temperature=3.0),
    SamplingParams(min_p=0.999),
    SamplingParams(top_k=1, top_p=0.5, min_p=0.5),
], ids=["top_k1", "top_k1_hot", "top_p_tiny", "top_p_tiny_hot", "min_p_high", "all"])
def test_filters_that_reduce_to_argmax(sp):
    torch.manual_seed(2)
    logits = torch.randn(64, 100) * 0.5     # flat distributions: sampling would wander
    seqs = [make_seq(sp) for _ in range(64)]
    out = run(seqs, logits)
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("top_p", [1.0, 0.95])     # 1.0: threshold path, 0.95: sorted path
def test_top_k_only_top_k_tokens_appear(top_p):
    V, k, n = 30, 4, 3000
    torch.manual_seed(3)
    row = torch.randn(V) * 0.3   # nearly flat so every kept token is drawn often
    tokens = sample_many(SamplingParams(top_k=k, top_p=top_p), row, n)
    allowed = set(row.topk(k).indices.tolist())
    assert set(tokens.tolist()) == allowed


def test_top_k_rows_mixed_with_unfiltered_rows():
    V, n = 25, 400
    torch.manual_seed(4)
    row = torch.randn(V) * 0.3
    seqs = [make_seq(SamplingParams(top_k=2)) if i % 2 == 0 else make_seq(SamplingParams())
            for i in range(n)]
    out = run(seqs, row.expand(n, -1).contiguous())
    top2 = set(row.topk(2).indices.tolist())
    assert set(out.token_ids[0::2].tolist()) == top2
    assert len(set(out.token_ids[1::2].tolist())) > 10     # unfiltered rows range widely


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])          # sorted: 1 (.4), 3 (.3), 2 (.2), 0 (.1)
    row = probs.log()
    # cum: .4, .7 -> top_p .5 keeps {1, 3}; top_p .7 keeps {1, 3} too; .71 keeps {1, 3, 2}
    for top_p, keep in [(0.5, {1, 3}), (0.4, {1}), (0.71, {1, 2, 3})]:
        tokens = sample_many(SamplingParams(top_p=top_p), row, 4000, seed=5)
        assert set(tokens.tolist()) == keep, top_p
    tokens = sample_many(SamplingParams(top_p=0.5), row, 8000, seed=6)
    frac = (tokens == 1).float().mean().item()
    assert abs(frac - 4 / 7) < 0.03                         # renormalised 0.4 / 0.7


def test_top_k_then_top_p_on_renormalised_distribution():
    probs = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.1])
    # top_k=2 renormalises to .583/.417; top_p .55 then keeps only token 0
    tokens = sample_many(SamplingParams(top_k=2, top_p=0.55), probs.log(), 2000, seed=7)
    assert set(tokens.tolist()) == {0}
    tokens = sample_many(SamplingParams(top_k=3, top_p=0.65), probs.log(), 4000, seed=7)
    assert set(tokens.tolist()) == {0, 1}   # .4375 + .3125 >= .65


def test_min_p_drops_unlikely_tokens():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    tokens = sample_many(SamplingParams(min_p=0.35), probs.log(), 4000, seed=8)  # cut at .175
    assert set(tokens.tolist()) == {0, 1}
    tokens = sample_many(SamplingParams(min_p=0.2), probs.log(), 4000, seed=8)   # cut at .1
    assert set(tokens.tolist()) == {0, 1, 2}


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    n = tokens.numel()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * n
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax(temperature):
    n = 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.3, -1.0])
    tokens = sample_many(SamplingParams(temperature=temperature), row, n, seed=9)
    chi2 = _chi_square(tokens, torch.softmax(row / temperature, -1))
    assert chi2 < 25.0    # 5 dof: p ~ 1e-4


def test_seeded_rows_distribution_matches_softmax():
    steps = 3000
    row = torch.tensor([0.2, 1.0, -0.3, 0.0, 0.6])
    seq = make_seq(SamplingParams(seed=1234))
    gens: dict[int, torch.Generator] = {}
    toks = []
    for _ in range(steps):
        toks.append(run([seq], row.unsqueeze(0), gens).token_ids[0].item())
    assert _chi_square(torch.tensor(toks), torch.softmax(row, -1)) < 23.0   # 4 dof
