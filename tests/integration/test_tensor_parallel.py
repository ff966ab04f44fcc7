"""Tensor parallelism through the offline API, real rank processes over Gloo on the CPU: TP2
(and an uneven TP3) generate what TP1 generates on the tiny fp32 presets and the embedded model
(greedy, seeded sampling, chunked prefill with mixed steps, preemption); a rank that dies ends
the engine with RankFailure instead of a hang."""
from __future__ import annotations

import time

import pytest

from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.parallel import RankFailure

PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 9 * i)] for i in range(6)]
PROMPTS += [PROMPTS[4][:30] + [11, 12, 13]]           # a shared prefix: a prefix-cache hit
# small steps and a small pool: chunked prompts in mixed steps, and preemption
ENGINE = {"device": "cpu", "num_kv_blocks": 10, "max_num_batched_tokens": 32, "max_num_seqs": 4}


def _generate(model: str, tp: int, params: list[SamplingParams], prompts=PROMPTS, **engine):
    with LLM(model, tensor_parallel_size=tp, **{**ENGINE, **engine}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.engine.stats()
    return outs, stats


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_tp2_equals_tp1(model):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=True) for _ in PROMPTS]
    params[1] = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=True)
    one, stats1 = _generate(model, 1, params)
    two, stats2 = _generate(model, 2, params)
    assert stats1["num_preemptions"] > 0 and stats2["num_preemptions"] == stats1["num_preemptions"]
    assert stats2["num_total_blocks"] == 10
    for a, b in zip(one, two):
        assert a.token_ids == b.token_ids
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)


def test_embedded_model_tp2_and_uneven_tp3_equal_tp1(offline):
    """SmolLM2's 9 query / 3 KV heads: TP2 splits its KV heads 2 + 1, TP3 one each (TP1: the
    session's offline engine, tests/integration/conftest.py)."""
    prompts = [offline.apply_chat_template([{"role": "user", "content": q}])
               for q in ("What is the capital of France?", "Name three primary colors.")]
    want = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert want[0].text.startswith("The capital of France is Paris")
    for tp in (2, 3):
        got, _ = _generate("default", tp, [SamplingParams(temperature=0, max_tokens=12)] * 2, prompts,
                           num_kv_blocks=64, max_num_batched_tokens=16384)
        assert [o.token_ids for o in got] == [o.token_ids for o in want], tp


def test_dead_rank_ends_the_engine():
    llm = LLM("tiny-llama", tensor_parallel_size=2, **ENGINE)
    try:
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        follower = llm.engine.model_runner.leader.procs[0]
        follower.kill()
        follower.wait(30)
        start = time.monotonic()
        with pytest.raises(RankFailure, match="rank 1 .* exited"):
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert time.monotonic() - start < 30
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    finally:
        llm.close()
