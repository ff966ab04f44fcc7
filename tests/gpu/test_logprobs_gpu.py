"""The sampler's logit_bias / min_tokens / top-logprob paths and the prompt-logprob path on CUDA,
against torch references on fresh random inputs, and prompt logprobs through the engine (tiny
fp32 Qwen3, CUDA graphs on, chunked or not) against HF transformers."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.engine.sequence import Sequence
from pdserve.common.layers.position_logprobs import position_logprobs
from pdserve.common.layers.sampler import Sampler, prepare_sampling
from tests.unit.hf_models import make_tiny_checkpoint

CUDA = torch.device("cuda")
V = 32000
EOS = (2,)


def _seq(sp: SamplingParams, completion: int = 0) -> Sequence:
    seq = Sequence([1, 2, 3], sp, 16)
    for _ in range(completion):
        seq.append_token(5)
    return seq


@pytest.mark.parametrize("trial", range(3))
def test_bias_min_tokens_and_top_logprobs_match_torch_on_gpu(trial):
    gen = torch.Generator().manual_seed(trial)
    B = 64
    logits = (torch.randn(B, V, generator=gen) * 4).to(CUDA, torch.bfloat16)
    params, biases = [], []
    for i in range(B):
        ids = torch.randint(0, V, (8,), generator=gen).unique().tolist()
        vals = (torch.rand(len(ids), generator=gen) * 200 - 100).tolist()
        bias = tuple(zip(ids, vals)) if i % 2 else ()
        params.append(SamplingParams(temperature=0.0, logprobs=True, top_logprobs=5, logit_bias=bias,
                                     min_tokens=3 if i % 3 == 0 else 0, stop_token_ids=(7,)))
        biases.append(bias)
    seqs = [_seq(sp, completion=i % 5) for i, sp in enumerate(params)]
    batch = prepare_sampling(seqs, V, CUDA, {}, EOS)
    out = Sampler()(logits, batch)
    torch.cuda.synchronize()
    raw = logits.float().cpu()
    ref = raw.clone()
    for i, (sp, seq) in enumerate(zip(params, seqs)):
        for t, b in biases[i]:
            ref[i, t] += b
        if seq.num_completion_tokens < sp.min_tokens:
            ref[i, [7, *EOS]] = float("-inf")
    assert torch.equal(out.token_ids.cpu(), ref.argmax(dim=-1))
    lp = torch.log_softmax(raw, dim=-1)
    assert torch.allclose(out.logprobs.cpu(), lp.gather(1, out.token_ids.cpu().unsqueeze(1)).squeeze(1), atol=1e-4)
    assert torch.allclose(out.top_logprobs.cpu(), lp.topk(5, dim=-1).values, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_logprobs_match_log_softmax_on_gpu(dtype):
    gen = torch.Generator().manual_seed(7)
    head = torch.nn.Linear(256, V, bias=False).to(CUDA, dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, 256, generator=gen).to(dtype) * 0.05)
    hidden = torch.randn(700, 256, generator=gen).to(CUDA, dtype)
    targets = torch.randint(0, V, (700,), generator=gen).to(CUDA)
    with torch.no_grad():
        out = position_logprobs(head, hidden, targets, 20)
        ref = torch.log_softmax(head(hidden).float(), dim=-1)
    assert torch.allclose(out.logprobs, ref.gather(1, targets.unsqueeze(1)).squeeze(1), atol=1e-4)
    assert torch.allclose(out.top_logprobs, ref.topk(20, dim=-1).values, atol=1e-4)


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_hf_on_gpu(tmp_path, chunked):
    model = make_tiny_checkpoint("qwen3", tmp_path, seed=2).to(CUDA)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 33, 200)]
    kwargs = {"enable_chunked_prefill": True, "max_num_batched_tokens": 64, "max_num_seqs": 8} if chunked else {}
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", num_kv_blocks=256, **kwargs)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=True, top_logprobs=3,
                        prompt_logprobs=True)
    for _ in range(2):                  # the second time from a warm prefix cache: scored again
        for prompt, out in zip(prompts, llm.generate(prompts, sp, use_tqdm=False)):
            with torch.no_grad():
                ref = torch.log_softmax(model(torch.tensor([prompt], device=CUDA)).logits[0, :-1].float(), -1)
            want = ref.gather(1, torch.tensor(prompt[1:], device=CUDA).unsqueeze(1)).squeeze(1).cpu()
            assert torch.allclose(torch.tensor(out.prompt_logprobs), want, atol=1e-3)
            assert out.num_cached_tokens == 0
    assert llm.engine.block_manager.is_whole()
