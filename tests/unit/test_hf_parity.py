"""Greedy output must equal HF transformers' token for token (tiny random Qwen3 / Qwen2 / Llama),
except after an HF near-tie (tests/unit/hf_models.py: assert_greedy_matches)."""
from __future__ import annotations

import random

import pytest

from pdserve.common.engine import LLM, SamplingParams
from tests.unit.hf_models import assert_greedy_matches, hf_greedy, make_tiny_checkpoint

MAX_NEW = 24


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(48)]          # 3 full blocks of 16
    plain = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 16, 17, 40)]
    prefixed = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 9, 16, 30)]
    return plain + prefixed


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    model = make_tiny_checkpoint(request.param, path)
    prompts = _prompts()
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return path, prompts, expected, model


def _generate(path, prompts, **kwargs):
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    return llm, [o.token_ids for o in outs]


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_matches_hf_with_prefix_hits(checkpoint, overlap):
    path, prompts, expected, model = checkpoint
    llm, got = _generate(path, prompts, num_kv_blocks=256, async_scheduling=overlap)
    assert_greedy_matches(model, prompts, got, expected)
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 48 * 3   # later prompts reuse the shared prefix
    assert llm.engine.block_manager.is_whole()


def test_greedy_matches_hf_sequential_prefix_reuse(checkpoint):
    """A second generate over the same prompts is served from the prefix cache and still matches."""
    path, prompts, expected, model = checkpoint
    llm, first = _generate(path, prompts, num_kv_blocks=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    assert_greedy_matches(model, prompts, [o.token_ids for o in outs], expected)
    assert all(o.num_cached_tokens > 0 for o, p in zip(outs, prompts) if len(p) > 16)
    assert llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_matches_hf_under_preemption(checkpoint, overlap):
    path, prompts, expected, model = checkpoint
    # 12 blocks of 16 tokens: the longest request alone needs 7 at the end; preemption must happen
    llm, got = _generate(path, prompts, num_kv_blocks=12, async_scheduling=overlap)
    assert_greedy_matches(model, prompts, got, expected)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.is_whole()


def test_greedy_matches_hf_with_a_smaller_budget_beside_decode_rows(checkpoint):
    """Steps without decode rows take 64 tokens, steps with them 20 (--max-mixed-batched-tokens):
    the prompts are cut into chunks of both sizes and the outputs still equal HF's."""
    path, prompts, expected, model = checkpoint
    llm, got = _generate(path, prompts, num_kv_blocks=256, async_scheduling=True,
                         max_num_seqs=16, max_num_batched_tokens=64, max_mixed_batched_tokens=20)
    assert_greedy_matches(model, prompts, got, expected)
    assert llm.engine.stats()["max_num_batched_tokens"] == 20       # what the router models
    assert llm.engine.block_manager.is_whole()


def test_overlapped_prefill_batches_match_hf(checkpoint):
    """Whole prompts spread over several prefill steps (128 tokens each at most, no chunking): each
    prefill is launched before the previous step's tokens are read, and the outputs still equal
    HF's. (Chunked steps: test_chunked_prefill.py.)"""
    path, prompts, expected, model = checkpoint
    llm, got = _generate(path, prompts, num_kv_blocks=256, async_scheduling=True, max_model_len=128,
                         max_num_batched_tokens=128, enable_chunked_prefill=False)
    assert_greedy_matches(model, prompts, got, expected)
    assert llm.engine.block_manager.is_whole() and llm.engine.pending is None


def test_overlapped_prefill_only_holds_blocks_after_the_first_token(checkpoint):
    """A prefill-only request (a prefill worker's) under overlap: one token, blocks kept until
    released, the same first token as HF's."""
    path, prompts, expected, model = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=True)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    seqs = [eng.add_request(p, params, prefill_only=True) for p in prompts]
    eng.add_request(prompts[0], params, request_id="decoding")       # a normal request beside them
    while eng.has_unfinished():
        eng.step()
    assert set(eng.kv_handoff.held) == {s.request_id for s in seqs}
    for seq, exp, prompt in zip(seqs, expected, prompts):
        assert seq.token_ids == prompt + exp[:1] and seq.block_table
    for seq in seqs:
        eng.kv_handoff.release(seq)
    assert eng.block_manager.is_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_launch_hook_and_first_token_that_ends_the_request(checkpoint, overlap):
    """The engine calls ``on_prefill_launch`` once per prefill step, before the tokens are read,
    with the rows of its launched tokens; a prefill-only request whose first token ends it
    (max_tokens 1) still keeps its blocks (a KV send may be reading them) until released."""
    path, prompts, expected, model = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=overlap)
    eng = llm.engine
    seen = []
    eng.on_prefill_launch = lambda seqs, launched: seen.append(
        [(s.request_id, int(launched.token_ids[i])) for i, s in enumerate(seqs)])
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seqs = [eng.add_request(p, params, prefill_only=True) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    launched = {rid: tok for step in seen for rid, tok in step}
    assert launched == {s.request_id: exp[0] for s, exp in zip(seqs, expected)}
    assert set(eng.kv_handoff.held) == {s.request_id for s in seqs}
    assert all(s.finish_reason is not None and s.block_table for s in seqs)
    for seq in seqs:
        eng.kv_handoff.release(seq)
    assert eng.block_manager.is_whole()


def test_overlapped_decode_stops_on_eos_one_step_late_without_extra_tokens(checkpoint):
    """With overlap, a sequence that stops on a token value gets no extra token and frees its blocks."""
    path, prompts, expected, model = checkpoint
    stop_at = {i: exp[5] for i, exp in enumerate(expected)}      # the 6th generated token stops each
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=256, async_scheduling=True)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=(stop_at[i],))
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, exp, i in zip(outs, expected, range(len(prompts))):
        cut = exp.index(stop_at[i]) + 1
        assert out.token_ids == exp[:cut] and out.finish_reason == "stop"
    assert llm.engine.block_manager.is_whole() and llm.engine.pending is None


def test_tie_aware_check_fails_on_a_token_that_is_not_greedy(checkpoint):
    path, prompts, expected, model = checkpoint
    wrong = [list(e) for e in expected]
    wrong[1][3] = (wrong[1][3] + 1) % 512
    with pytest.raises(AssertionError, match="prompt 1, token 3"):
        assert_greedy_matches(model, prompts, wrong, expected)
