"""Prompt logprobs, top logprobs, logit_bias and min_tokens in the engine (tiny random Qwen3,
CPU), against HF transformers' log_softmax over the same checkpoint: whole prompts and chunked
prefills, with and without overlapped steps; a prompt in the prefix cache is scored again (no
hit skips a position); pools whole afterwards."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.common.engine import LLM, SamplingParams
from tests.unit.hf_models import make_tiny_checkpoint

K = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    model = make_tiny_checkpoint("qwen3", path, seed=4)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (2, 17, 40, 70)]
    return path, model, prompts


@torch.no_grad()
def hf_prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[n-1, V] log_softmax of the logits at prompt positions 0..n-2."""
    logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(model, prompt, out) -> None:
    ref = hf_prompt_logprobs(model, prompt)
    targets = torch.tensor(prompt[1:])
    assert len(out.prompt_logprobs) == len(prompt) - 1
    got = torch.tensor(out.prompt_logprobs)
    assert torch.allclose(got, ref.gather(1, targets.unsqueeze(1)).squeeze(1), atol=2e-4)
    assert len(out.prompt_top_logprobs) == len(prompt) - 1
    for pos, (ids, lps) in enumerate(out.prompt_top_logprobs):
        assert len(ids) == K
        assert torch.allclose(torch.tensor(lps), ref[pos].topk(K).values, atol=2e-4)
        assert torch.allclose(ref[pos][ids], torch.tensor(lps), atol=2e-4)


@pytest.mark.parametrize("chunked,overlap", [(False, False), (True, False), (True, True)])
def test_prompt_logprobs_match_hf(checkpoint, chunked, overlap):
    path, model, prompts = checkpoint
    kwargs = {"enable_chunked_prefill": True, "max_num_batched_tokens": 24, "max_num_seqs": 4} if chunked else {}
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=128,
              async_scheduling=overlap, **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=True, top_logprobs=K,
                        prompt_logprobs=True)
    for _ in range(2):            # the second round finds the prompts in the prefix cache
        outs = llm.generate(prompts, sp, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            check(model, prompt, out)
            assert out.num_cached_tokens == 0
            assert len(out.top_logprobs) == len(out.token_ids) == 3
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert plain[3].num_cached_tokens > 0 and not plain[3].prompt_logprobs   # others still hit
    assert [o.token_ids for o in plain] == [o.token_ids for o in outs]
    assert llm.engine.block_manager.is_whole()


def test_top_logprobs_of_generated_tokens_match_hf(checkpoint):
    path, model, prompts = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=128)
    out = llm.generate([prompts[2]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True,
                                                    top_logprobs=5), use_tqdm=False)[0]
    full = prompts[2] + out.token_ids
    ref = hf_prompt_logprobs(model, full + [0])[len(prompts[2]) - 1:]     # positions of the generated
    for i, (tok, lp, (ids, lps)) in enumerate(zip(out.token_ids, out.logprobs, out.top_logprobs)):
        assert ids[0] == tok                                   # greedy: the top token was chosen
        assert abs(lp - ref[i][tok].item()) < 2e-4
        assert torch.allclose(torch.tensor(lps), ref[i].topk(5).values, atol=2e-4)


def test_logit_bias_and_min_tokens_in_the_engine(checkpoint):
    path, _, prompts = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=128)
    out = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                    logit_bias=((77, 100.0),)), use_tqdm=False)[0]
    assert out.token_ids == [77] * 5
    first = llm.generate([prompts[1]], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0].token_ids[0]
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,))
    assert len(llm.generate([prompts[1]], stop, use_tqdm=False)[0].token_ids) == 1
    held = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(first,), min_tokens=4)
    out = llm.generate([prompts[1]], held, use_tqdm=False)[0]
    assert len(out.token_ids) >= 4 and first not in out.token_ids[:4]
    assert llm.engine.block_manager.is_whole()
