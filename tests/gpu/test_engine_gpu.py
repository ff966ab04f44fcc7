"""The engine on CUDA against HF transformers: greedy identity (tiny fp32) and bf16 prefill logits
(Qwen3-0.6B geometry), through the Triton backend with CUDA-graph decode."""
from __future__ import annotations

import json
import random

import pytest
import torch

from common.config import ModelConfig
from common.context import forward_context
from common.engine import LLM, SamplingParams
from common.loader import PRESET_DIR
from common.models.decoder import DecoderForCausalLM
from tests.unit.hf_models import hf_greedy, make_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
@pytest.mark.parametrize("eager", [False, True])
def test_tiny_fp32_greedy_matches_hf_on_gpu(tmp_path, kind, eager):
    model = make_tiny_checkpoint(kind, tmp_path).to("cuda")
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 64)] + [shared + [5, 6], shared + [7] * 20]
    expected = [hf_greedy(model, p, 32) for p in prompts]
    llm = LLM(str(tmp_path), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
              attention_backend="triton", enforce_eager=eager, max_num_seqs=8)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.block_manager.is_whole()


def test_qwen3_06b_bf16_prefill_logits_match_hf():
    import transformers as tf
    cfg_dict = json.loads((PRESET_DIR / "qwen3-0.6b.json").read_text())
    torch.manual_seed(0)
    hf_cfg = tf.AutoConfig.for_model(**cfg_dict)
    with torch.device("cuda"):
        hf = tf.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    ours_cfg = ModelConfig.from_hf_dict(cfg_dict, "qwen3-0.6b")
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        ours = DecoderForCausalLM(ours_cfg, "triton")
    torch.set_default_dtype(torch.float32)
    ours.load_weights(hf.state_dict().items())
    lengths = [37, 300, 129]
    prompts = [torch.randint(0, 150000, (n,), device="cuda") for n in lengths]
    bs, L, Hkv, D = 16, ours_cfg.num_hidden_layers, ours_cfg.num_key_value_heads, ours_cfg.head_dim
    blocks_per = [-(-n // bs) for n in lengths]
    kv = torch.zeros(sum(blocks_per), L, 2, bs, Hkv, D, dtype=torch.bfloat16, device="cuda")
    for i, layer in enumerate(ours.layers):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = kv[:, i, 0], kv[:, i, 1]
    perm = torch.randperm(sum(blocks_per)).tolist()   # blocks in random order
    tables, start = [], 0
    for nb in blocks_per:
        tables.append(perm[start:start + nb] + [-1] * (max(blocks_per) - nb))
        start += nb
    slots = [tables[b][p // bs] * bs + p % bs for b, n in enumerate(lengths) for p in range(n)]
    from common.context import ForwardContext
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    ctx = ForwardContext(is_prefill=True, slot_mapping=torch.tensor(slots, dtype=torch.int32, device="cuda"),
                         context_lens=torch.tensor(lengths, dtype=torch.int32, device="cuda"),
                         block_tables=torch.tensor(tables, dtype=torch.int32, device="cuda"),
                         cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device="cuda"), max_seqlen_q=max(lengths))
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(n, device="cuda") for n in lengths])
    with torch.inference_mode(), forward_context(ctx):
        logits = ours.compute_logits(ours(ids, pos)).float()
    with torch.inference_mode():
        ref = torch.cat([hf(p[None]).logits[0] for p in prompts]).float()
    rel = (logits - ref).norm() / ref.norm()
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"bf16 prefill logits: rel err {rel:.2e}, top-1 agreement {top1:.3f}")
    assert rel < 3e-2 and top1 > 0.9
