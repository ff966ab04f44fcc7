"""Sampler: per-request seeds, penalties, logprobs, mixed batches, no host sync (CPU).
Greedy, filters and distributions: test_sampler.py."""
from __future__ import annotations

import math

import pytest
import torch
from sampler_cases import CPU, make_seq, run, sample_many

from pdserve.common.layers.sampler import Sampler, prepare_sampling
from pdserve.common.sampling_params import SamplingParams

# ----------------------------------------------------------------------------- seeds

def _step_logits(step: int, V: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(V, generator=g) * 0.5


def _seeded_run(seed: int, layout: list[str], pos: int, steps: int = 20, V: int = 50,
                temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1) -> list[int]:
    """Decode ``steps`` tokens for a seeded request sitting at row ``pos`` of a batch whose
    other rows follow ``layout`` ('g' greedy, 's' unseeded, 'S' other seed, 'p' penalised with
    top-k, 'P' top-p, 'Q' top-p + top-k + min-p). The layouts send the target row down each of
    the sampler's paths (no filter, top-k threshold, full sort, partial top-k sort)."""
    others = {"g": SamplingParams(temperature=0.0), "s": SamplingParams(temperature=0.9),
              "S": SamplingParams(seed=seed + 1),
              "p": SamplingParams(repetition_penalty=1.2, top_k=7),
              "P": SamplingParams(top_p=0.8), "Q": SamplingParams(top_p=0.7, top_k=20, min_p=0.01)}
    target = make_seq(SamplingParams(seed=seed, temperature=temperature, top_p=top_p, top_k=top_k))
    rest = [make_seq(others[c]) for c in layout]
    seqs = rest[:pos] + [target] + rest[pos:]
    gens: dict[int, torch.Generator] = {}
    noise = torch.Generator().manual_seed(len(layout) * 31 + pos)
    for step in range(steps):
        logits = torch.randn(len(seqs), V, generator=noise)
        logits[pos] = _step_logits(step, V)
        out = run(seqs, logits, gens).token_ids
        for seq, tok in zip(seqs, out.tolist()):
            seq.append_token(tok)
    return target.completion_token_ids


@pytest.mark.parametrize("kw", [{}, {"top_p": 0.9}, {"top_k": 10, "temperature": 0.8}])
def test_seed_reproducible_across_batch_compositions(kw):
    torch.manual_seed(10)
    ref = _seeded_run(42, [], 0, **kw)
    torch.manual_seed(11)   # a different global RNG state must not matter
    assert _seeded_run(42, ["s", "g", "S", "p"], 3, **kw) == ref
    torch.manual_seed(12)
    assert _seeded_run(42, ["S", "s", "s", "s", "g", "s", "p"], 0, **kw) == ref
    torch.manual_seed(13)
    assert _seeded_run(42, ["g", "s"], 2, **kw) == ref
    assert _seeded_run(42, ["P", "s"], 1, **kw) == ref      # full sort path
    assert _seeded_run(42, ["p", "Q", "g"], 1, **kw) == ref  # partial sort (all rows top-k)
    assert len(set(ref)) > 3     # it really sampled


def test_different_seeds_differ():
    a = _seeded_run(1, ["s"], 0)
    b = _seeded_run(2, ["s"], 0)
    c = _seeded_run(1, ["g"], 1)
    assert a != b and a == c


def test_seeded_generator_resumes_on_an_imported_sequence():
    """A sequence first seen with completion tokens (e.g. its first token was sampled by a
    prefill worker) continues the seed's stream where it would have been."""
    V = 40
    sp = SamplingParams(seed=77)
    full = make_seq(sp)
    gens: dict[int, torch.Generator] = {}
    for step in range(6):
        full.append_token(run([full], _step_logits(step, V).unsqueeze(0), gens).token_ids.item())
    imported = make_seq(sp, completion=full.completion_token_ids[:2])
    gens2: dict[int, torch.Generator] = {}
    for step in range(2, 6):
        imported.append_token(run([imported], _step_logits(step, V).unsqueeze(0), gens2)
                              .token_ids.item())
    assert imported.completion_token_ids == full.completion_token_ids


def test_unseeded_rows_follow_global_rng():
    row = torch.zeros(1000)
    a = sample_many(SamplingParams(), row, 16, seed=123)
    b = sample_many(SamplingParams(), row, 16, seed=123)
    c = sample_many(SamplingParams(), row, 16, seed=124)
    assert torch.equal(a, b) and not torch.equal(a, c)


# ----------------------------------------------------------------------------- penalties

def test_repetition_penalty_changes_greedy_pick():
    V = 10
    logits = torch.zeros(1, V)
    logits[0, 4] = 2.0
    logits[0, 6] = 1.5
    # token 4 seen in the prompt: 2.0 / 2 = 1.0 < 1.5
    out = run([make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(4, 1))],
              logits)
    assert out.token_ids.item() == 6
    # ... or in the completion
    out = run([make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(1,),
                        completion=(4,))], logits)
    assert out.token_ids.item() == 6
    # unseen top token: unchanged
    out = run([make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(1,))],
              logits)
    assert out.token_ids.item() == 4
    # negative logits are multiplied: seen token 2 at -0.1 becomes -0.2 < -0.15
    logits = torch.full((1, 3), -5.0)
    logits[0, 2], logits[0, 0] = -0.1, -0.15
    out = run([make_seq(SamplingParams(temperature=0.0, repetition_penalty=2.0), prompt=(2,))],
              logits)
    assert out.token_ids.item() == 0


def test_repetition_penalty_lowers_sampled_probability():
    n = 6000
    row = torch.tensor([1.0, 1.0, 0.0, 0.0, 0.0])
    torch.manual_seed(14)
    seqs = [make_seq(SamplingParams(repetition_penalty=3.0), prompt=(0,)) for _ in range(n)]
    tokens = run(seqs, row.expand(n, -1).contiguous()).token_ids
    frac0 = (tokens == 0).float().mean().item()
    expected = torch.softmax(torch.tensor([1 / 3, 1.0, 0.0, 0.0, 0.0]), -1)[0].item()
    assert abs(frac0 - expected) < 0.03 and frac0 < torch.softmax(row, -1)[0].item() - 0.1


def test_presence_and_frequency_penalties():
    V = 8
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 5], logits[0, 1] = 2.0, 1.5, 1.0
    greedy = dict(temperature=0.0)
    # presence: 3 seen once in the completion -> 2.0 - 1.0 = 1.0 < 1.5
    assert run([make_seq(SamplingParams(presence_penalty=1.0, **greedy), completion=(3,))],
               logits).token_ids.item() == 5
    # presence is subtracted once whatever the count: 3 -> 2.0 - 0.4 = 1.6 > 1.5
    assert run([make_seq(SamplingParams(presence_penalty=0.4, **greedy), completion=(3, 3, 3))],
               logits).token_ids.item() == 3          # 1.6 > 1.5
    # frequency: 3 seen 3 times * 0.2 = 0.6 -> 1.4 < 1.5
    assert run([make_seq(SamplingParams(frequency_penalty=0.2, **greedy), completion=(3, 3, 3))],
               logits).token_ids.item() == 5
    # frequency with a single occurrence is not enough
    assert run([make_seq(SamplingParams(frequency_penalty=0.2, **greedy), completion=(3,))],
               logits).token_ids.item() == 3
    # both: 3 -> 2 - .3 - .3 = 1.4, 5 (twice) -> 1.5 - .3 - .6 = .6 -> token 3 wins
    assert run([make_seq(SamplingParams(presence_penalty=0.3, frequency_penalty=0.3, **greedy),
                         completion=(3, 5, 5))], logits).token_ids.item() == 3
    # prompt tokens are not penalised by presence / frequency
    assert run([make_seq(SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, **greedy),
                         prompt=(3, 3, 3))], logits).token_ids.item() == 3
    # negative presence penalty encourages repetition
    assert run([make_seq(SamplingParams(presence_penalty=-2.0, **greedy), completion=(1,))],
               logits).token_ids.item() == 1


def test_penalties_are_per_row():
    V = 6
    logits = torch.zeros(3, V)
    logits[:, 2], logits[:, 4] = 2.0, 1.5
    seqs = [make_seq(SamplingParams(temperature=0.0, repetition_penalty=4.0), prompt=(2,)),
            make_seq(SamplingParams(temperature=0.0), prompt=(2,), completion=(2, 2)),
            make_seq(SamplingParams(temperature=0.0, frequency_penalty=1.0), completion=(2,))]
    assert run(seqs, logits).token_ids.tolist() == [4, 2, 4]


# ----------------------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax_at_chosen():
    V, B = 64, 8
    torch.manual_seed(15)
    logits = (torch.randn(B, V) * 2).to(torch.bfloat16)
    sps = [SamplingParams(temperature=0.0, logprobs=True),
           SamplingParams(temperature=0.0, repetition_penalty=1.8, logprobs=True),
           SamplingParams(temperature=0.7, top_k=5, logprobs=True),
           SamplingParams(temperature=1.3, top_p=0.8, logprobs=True, seed=3),
           SamplingParams(min_p=0.2, presence_penalty=1.0, frequency_penalty=0.5),
           SamplingParams(temperature=2.0),
           SamplingParams(temperature=0.0, top_k=3),
           SamplingParams(seed=9, logprobs=True)]
    seqs = [make_seq(sp, prompt=(0, 1, 2), completion=(3, 3, 4)) for sp in sps]
    out = run(seqs, logits)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1).gather(1, out.token_ids[:, None]).squeeze(1)
    assert (out.logprobs - expected).abs().max().item() < 1e-5
    assert (out.logprobs <= 0).all()


def test_no_logprobs_unless_asked():
    out = run([make_seq(SamplingParams()), make_seq(SamplingParams(temperature=0.0))],
              torch.randn(2, 10))
    assert out.logprobs is None


# ----------------------------------------------------------------------------- mixed batch

def test_mixed_batch_greedy_sampled_seeded():
    V = 80
    torch.manual_seed(16)
    logits = torch.randn(6, V)
    logits[2] = _step_logits(0, V)
    sps = [SamplingParams(temperature=0.0),
           SamplingParams(temperature=0.8, top_k=1),
           SamplingParams(seed=2024, top_p=0.9),
           SamplingParams(temperature=0.0, presence_penalty=2.0),
           SamplingParams(temperature=1.0, min_p=0.999),
           SamplingParams(temperature=1.0)]
    seqs = [make_seq(sp, completion=(int(logits[3].argmax()),) if i == 3 else ())
            for i, sp in enumerate(sps)]
    gens: dict[int, torch.Generator] = {}
    out = run(seqs, logits, gens)
    tok = out.token_ids.tolist()
    assert tok[0] == logits[0].argmax().item()
    assert tok[1] == logits[1].argmax().item()
    assert tok[4] == logits[4].argmax().item()
    penalised = logits[3].clone()
    penalised[logits[3].argmax()] -= 2.0
    assert tok[3] == penalised.argmax().item()
    assert 0 <= tok[5] < V
    # the seeded row alone gives the same token
    alone = run([make_seq(SamplingParams(seed=2024, top_p=0.9))], logits[2:3].clone())
    assert alone.token_ids.item() == tok[2]
    assert list(gens) == [seqs[2].seq_id]


def test_all_seeded_batch_and_empty_batch():
    V = 30
    sps = [SamplingParams(seed=s) for s in (1, 2, 3)]
    logits = torch.randn(3, V)
    a = run([make_seq(sp) for sp in sps], logits).token_ids
    b = run([make_seq(sp) for sp in reversed(sps)], logits.flip(0)).token_ids
    assert torch.equal(a, b.flip(0))
    out = run([], torch.empty(0, V))
    assert out.token_ids.shape == (0,)


def test_forward_makes_no_host_sync(monkeypatch):
    """forward never pulls a value to the host (.item(), .tolist(), bool(tensor), ...)."""
    V = 50
    sps = [SamplingParams(temperature=0.0, logprobs=True),
           SamplingParams(top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                          frequency_penalty=0.3, seed=1),
           SamplingParams(top_k=3), SamplingParams(top_p=0.5, presence_penalty=0.5)]
    seqs = [make_seq(sp, completion=(1, 2, 2)) for sp in sps]
    batch = prepare_sampling(seqs, V, CPU, {})
    logits = torch.randn(len(seqs), V)

    def forbidden(*_a, **_k):
        raise AssertionError("host sync inside Sampler.forward")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                 "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = Sampler()(logits, batch)
    monkeypatch.undo()
    assert out.token_ids.shape == (4,)
    assert math.isfinite(out.logprobs[0].item())
