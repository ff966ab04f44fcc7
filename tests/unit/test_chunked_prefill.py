"""Chunked prefill: greedy output equals HF transformers' token for token whatever the chunk
boundaries (mid-block, on a block edge, after a cached prefix, a budget smaller than one block,
a prompt many times the budget), with decode rows mixed into the same steps, with overlapped
steps, and with partly prefilled sequences preempted in a tiny pool; the pool is whole after."""
from __future__ import annotations

import random

import pytest

from pdserve.common.engine import LLM, SamplingParams
from tests.unit.hf_models import hf_greedy, make_tiny_checkpoint

MAX_NEW = 12
BS = 16


def _prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 512) for _ in range(3 * BS)]          # a cached prefix of 3 blocks
    plain = [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 16, 31, 70)]
    prefixed = [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (1, 16, 21)]
    return plain + prefixed


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"chunk-{request.param}")
    model = make_tiny_checkpoint(request.param, path)
    prompts = _prompts()
    long_prompt = [random.Random(7).randrange(3, 512) for _ in range(8 * 24 + 5)]   # > 8 budgets of 24
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts + [long_prompt]]
    return path, prompts, long_prompt, expected


def _llm(path, budget: int, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=budget,
               max_num_seqs=min(budget, 8), enable_chunked_prefill=True, **kwargs)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _run_staggered(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, int]]:
    """Add one prompt every other step, so prompts are chunked while others decode; returns the
    outputs in prompt order and how many steps of each kind ran."""
    eng = llm.engine
    pending = [(f"r{i}", p) for i, p in enumerate(prompts)]
    outs: dict[str, list[int]] = {}
    kinds = {"prefill": 0, "decode": 0, "mixed": 0}
    step = 0
    while pending or eng.has_unfinished():
        if pending and step % 2 == 0:
            rid, prompt = pending.pop(0)
            eng.add_request(prompt, _greedy(), request_id=rid)
        out = eng.step()
        if out.num_decode_rows and out.num_prefill_tokens:
            kinds["mixed"] += 1
        elif out.num_prefill_tokens or out.num_decode_rows:
            kinds["prefill" if out.num_prefill_tokens else "decode"] += 1
        for seq in out.finished:
            outs[seq.request_id] = seq.completion_token_ids
        step += 1
        assert step < 10_000
    return [outs[f"r{i}"] for i in range(len(prompts))], kinds


@pytest.mark.parametrize("budget", [5, 16, 24])       # < one block, a block edge, mid-block
@pytest.mark.parametrize("overlap", [False, True])
def test_chunks_at_every_boundary_match_hf(checkpoint, budget, overlap):
    path, prompts, _, expected = checkpoint
    llm = _llm(path, budget, num_kv_blocks=128, async_scheduling=overlap)
    got, kinds = _run_staggered(llm, prompts)
    assert got == expected[:len(prompts)]
    assert kinds["mixed"] > 0                                   # decode rows rode with chunks
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 2 * 3 * BS      # the shared prefix skipped whole blocks
    assert llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_eight_times_the_budget_while_others_decode(checkpoint, overlap):
    path, prompts, long_prompt, expected = checkpoint
    llm = _llm(path, 24, num_kv_blocks=128, max_model_len=512, async_scheduling=overlap)
    got, kinds = _run_staggered(llm, [prompts[3], long_prompt, prompts[1]])
    assert got == [expected[3], expected[-1], expected[1]]
    assert kinds["mixed"] >= 8                                  # the long prompt spanned >= 8 steps
    assert llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_partly_prefilled_sequences_preempted_in_a_tiny_pool(checkpoint, overlap):
    path, prompts, long_prompt, expected = checkpoint
    # 15 blocks: a 31-token prompt decodes into its 3rd block while the long prompt (13 blocks)
    # is being chunked and holds the rest: the long one is preempted mid-prompt, recomputed later
    llm = _llm(path, 8, num_kv_blocks=15, max_model_len=256, async_scheduling=overlap)
    eng = llm.engine
    preempted_mid_prompt = []
    original = eng.scheduler.preempt

    def preempt(seq):
        if seq.num_cached_tokens < seq.num_prompt_tokens:
            preempted_mid_prompt.append(seq.request_id)
        original(seq)

    eng.scheduler.preempt = preempt
    got, _ = _run_staggered(llm, [prompts[2], long_prompt, prompts[6]])
    assert got == [expected[2], expected[-1], expected[6]]
    assert preempted_mid_prompt
    assert eng.block_manager.is_whole()


def test_offline_generate_with_a_budget_smaller_than_the_context(checkpoint):
    """The offline API: every prompt at once, a budget smaller than the model's context."""
    path, prompts, long_prompt, expected = checkpoint
    llm = _llm(path, 24, num_kv_blocks=128, max_model_len=512)
    outs = llm.generate(prompts + [long_prompt], _greedy(), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_worker_ships_after_the_last_chunk(checkpoint, overlap):
    """A prefill worker's prompts (prefill-only) spanning several chunks: the launch hook (where
    the KV send starts) fires once per request, in the step of its last chunk, with the first
    token HF gives; the blocks are held for the send until released."""
    path, prompts, long_prompt, expected = checkpoint
    llm = _llm(path, 24, num_kv_blocks=128, max_model_len=512, async_scheduling=overlap)
    eng = llm.engine
    launched: dict[str, int] = {}

    def on_launch(seqs, step):
        for i, s in enumerate(seqs):
            assert s.request_id not in launched and s.num_cached_tokens + s.num_scheduled_tokens == s.num_tokens
            launched[s.request_id] = int(step.token_ids[i])

    eng.on_prefill_launch = on_launch
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    batch = [prompts[3], long_prompt, prompts[5]]
    seqs = [eng.add_request(p, params, request_id=f"p{i}", prefill_only=True) for i, p in enumerate(batch)]
    while eng.has_unfinished():
        eng.step()
    assert launched == {f"p{i}": exp[0] for i, exp in enumerate([expected[3], expected[-1], expected[5]])}
    assert set(eng.kv_handoff.held) == {s.request_id for s in seqs} and all(s.block_table for s in seqs)
    for s in seqs:
        eng.kv_handoff.release(s)
    assert eng.block_manager.is_whole()
