"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, seeds, logprobs (CPU)."""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.common.engine.sequence import Sequence
from pdserve.common.layers.sampler import Sampler, SamplerOutput, SamplingBatch, prepare_sampling
from pdserve.common.sampling_params import SamplingParams

CPU = torch.device("cpu")
BLOCK = 16


def make_seq(sp: SamplingParams, prompt=(1, 2, 3), completion=()) -> Sequence:
    seq = Sequence(list(prompt), sp, BLOCK)
    for t in completion:
        seq.append_token(t)
    return seq


def run(seqs, logits, generators=None) -> SamplerOutput:
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
