"""The offline API on the embedded model: HF parity on chat prompts, streaming, bad inputs."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.engine import LLM, InvalidParameter, SamplingParams

CHATS = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?"]


@pytest.fixture(scope="module")
def llm():
    return LLM("default", device="cpu", num_kv_blocks=256)


@pytest.fixture(scope="module")
def hf_model(llm):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(llm.engine.source.checkpoint_dir), dtype=torch.float32).eval()


def test_greedy_chat_matches_hf(llm, hf_model):
    prompts = [llm.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                    pad_token_id=2)[0, len(prompt):].tolist()
        assert out.token_ids == ref
    assert "Paris" in outs[0].text
    assert llm.engine.stats()["prefix_cache_hit_tokens"] > 0       # the chat template's system prompt is shared
    assert llm.engine.block_manager.is_whole()


def test_stream_yields_the_answer(llm):
    prompt = llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    text = "".join(llm.stream(prompt, SamplingParams(temperature=0, max_tokens=24)))
    assert text.strip() == "The capital of France is Paris."
    assert llm.engine.block_manager.is_whole()


@pytest.mark.parametrize("make, field", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(temperature=-0.1), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_k=-2), "top_k"),
])
def test_bad_sampling_params_name_the_field(make, field):
    with pytest.raises(InvalidParameter) as e:
        make()
    assert e.value.field == field and field in str(e.value)


def test_bad_prompts_leave_nothing_allocated(llm):
    with pytest.raises(InvalidParameter, match="prompt"):
        llm.generate([""], SamplingParams(max_tokens=4), use_tqdm=False)
    with pytest.raises(InvalidParameter, match="prompt"):
        llm.generate([[5] * (llm.engine.max_model_len + 1)], SamplingParams(max_tokens=4), use_tqdm=False)
    # a good prompt followed by a bad one: nothing of the good one is queued either
    with pytest.raises(InvalidParameter):
        llm.generate(["hello", ""], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.is_whole()


def test_unknown_model_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="preset"):
        LLM("no-such-preset")
    with pytest.raises(ValueError, match="block_size"):
        LLM("tiny-qwen3", block_size=3)


def test_warm_up_leaves_no_trace(llm):
    """The warm-up step (run at start-up on CUDA) leaves the pool, the prefix cache, the
    counters and the next outputs as they were."""
    from pdserve.common.engine.warmup import scratch_blocks, warm_up
    eng = llm.engine
    prompt = llm.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    params = SamplingParams(temperature=0, max_tokens=8)
    before = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    stats = eng.stats()
    scratch = scratch_blocks(eng.block_manager)
    assert scratch and eng.block_manager.num_cached_blocks > 0   # cached blocks exist and are avoided
    warm_up(eng.model_runner, scratch, eng.max_model_len)
    assert eng.stats() == stats and eng.block_manager.is_whole()
    assert llm.generate([prompt], params, use_tqdm=False)[0].token_ids == before
