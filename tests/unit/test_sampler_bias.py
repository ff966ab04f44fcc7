"""The sampler's logit_bias and min_tokens paths, and the prompt-logprob math
(layers/position_logprobs.py), each against a plain torch reference on fresh random logits
(CPU)."""
from __future__ import annotations

import pytest
import torch
from sampler_cases import CPU, make_seq

from pdserve.common.layers.logit_bias import build_logit_bias
from pdserve.common.layers.position_logprobs import position_logprobs
from pdserve.common.layers.sampler import Sampler, prepare_sampling
from pdserve.common.sampling_params import InvalidParameter, SamplingParams

V = 300
EOS = (2, 7)


def sample(seqs, logits, gens=None):
    batch = prepare_sampling(seqs, logits.shape[1], CPU, {} if gens is None else gens, EOS)
    return Sampler()(logits, batch), batch


def dense_bias(sp: SamplingParams, banned: list[int] = ()) -> torch.Tensor:
    """Reference: the row's additive bias as a dense [V] vector."""
    b = torch.zeros(V)
    for t, v in sp.logit_bias:
        b[t] += v
    for t in banned:
        b[t] = float("-inf")
    return b


@pytest.mark.parametrize("trial", range(3))
def test_logit_bias_greedy_and_seeded_rows_match_the_reference(trial):
    gen = torch.Generator().manual_seed(100 + trial)
    logits = torch.randn(4, V, generator=gen) * 3
    ids = torch.randperm(V, generator=gen)[:12].tolist()
    biases = (torch.rand(12, generator=gen) * 200 - 100).tolist()
    params = [SamplingParams(temperature=0.0, logit_bias=tuple(zip(ids[:6], biases[:6])), logprobs=True),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, seed=trial, logit_bias=tuple(zip(ids[6:], biases[6:]))),
              SamplingParams(temperature=0.0, logit_bias=((ids[0], 100.0),))]
    seqs = [make_seq(sp) for sp in params]
    out, _ = sample(seqs, logits)
    ref = torch.stack([logits[i] + dense_bias(sp) for i, sp in enumerate(params)])
    assert out.token_ids[0] == ref[0].argmax() and out.token_ids[1] == logits[1].argmax()
    assert out.token_ids[3] == ids[0]                       # +100 forces it
    # the chosen token's logprob is the raw one (before the bias), as without a bias
    raw = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids.unsqueeze(1)).squeeze(1), atol=1e-6)
    # seeded sampled row: the exponential race over softmax(ref / T) with the row's own stream
    g = torch.Generator().manual_seed(trial)
    noise = torch.empty(V).exponential_(generator=g).clamp_min_(torch.finfo(torch.float32).tiny)
    expect = (torch.softmax(ref[2] / 0.7, dim=-1) / noise).argmax()
    assert out.token_ids[2] == expect


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    logits = torch.full((4, V), -5.0)
    logits[:, 2] = 10.0          # EOS is by far the likeliest
    logits[:, 11] = 9.0          # then a stop id
    logits[:, 40] = 8.0
    sp = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(11,))
    early = [make_seq(sp, completion=[5] * n) for n in (0, 2)]
    late = make_seq(sp, completion=[5] * 3)
    ignore = make_seq(SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), completion=[5])
    out, batch = sample([*early, late, ignore], logits)
    assert out.token_ids.tolist() == [40, 40, 2, 2]        # ignore_eos: EOS is not a stop, not banned
    assert batch.per_step                                   # rebuilt each step (it depends on lengths)
    out, _ = sample([make_seq(SamplingParams(temperature=1.0, seed=s, min_tokens=2)) for s in range(4)], logits)
    assert not set(out.token_ids.tolist()) & set(EOS)


def test_min_tokens_row_entries_match_a_dense_reference():
    params = [SamplingParams(min_tokens=4, stop_token_ids=(9, 2), logit_bias=((9, 5.0), (20, -3.0))),
              SamplingParams(logit_bias=((299, 1.5),)), SamplingParams()]
    seqs = [make_seq(sp, completion=[1]) for sp in params]
    bias = build_logit_bias(seqs, V, CPU, EOS)
    assert bias is not None
    got = torch.zeros(3 * V).index_add(0, bias.index, bias.values).view(3, V)
    ref = torch.stack([dense_bias(params[0], [9, 2, 7]), dense_bias(params[1]), dense_bias(params[2])])
    assert torch.equal(got, ref)
    assert build_logit_bias([make_seq(SamplingParams())], V, CPU, EOS) is None


def test_bad_logit_bias_and_min_tokens_are_refused_naming_the_field():
    for kwargs in ({"logit_bias": ((1, 101.0),)}, {"logit_bias": ((1, 1.0), (1, 2.0))},
                   {"logit_bias": ((-1, 1.0),)}, {"logit_bias": tuple((i, 1.0) for i in range(301))}):
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**kwargs)
        assert e.value.field == "logit_bias"
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.field == "min_tokens"
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(prompt_logprobs=True)
    assert e.value.field == "prompt_logprobs"


@pytest.mark.parametrize("k,chunk", [(0, 256), (5, 7), (20, 1)])
def test_position_logprobs_match_log_softmax(k, chunk):
    gen = torch.Generator().manual_seed(k + chunk)
    head = torch.nn.Linear(16, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, 16, generator=gen))
    hidden = torch.randn(23, 16, generator=gen)
    targets = torch.randint(0, V, (23,), generator=gen)
    with torch.no_grad():
        out = position_logprobs(head, hidden, targets, k, chunk_rows=chunk)
        ref = torch.log_softmax(head(hidden).float(), dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, targets.unsqueeze(1)).squeeze(1), atol=1e-5)
    if k:
        assert out.top_logprobs is not None and out.top_token_ids is not None
        top = ref.topk(k, dim=-1)
        assert torch.allclose(out.top_logprobs, top.values, atol=1e-5)
        assert torch.allclose(ref.gather(1, out.top_token_ids), out.top_logprobs, atol=1e-5)
    else:
        assert out.top_token_ids is None
