"""The decode chain (Triton rows and the Gluon range) on the Qwen3-0.6B geometry against HF
transformers: decode-step logits (bf16, the same weights) through the chain and through the usual
forward, each compared with HF's logits for the same position."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.context import ForwardContext, forward_context
from pdserve.common.models import dataflow_decode
from pdserve.common.models.decoder import DecoderForCausalLM
from pdserve.common.ops.pdl import pdl_available
from tests.gpu.qwen3_06b import hf_and_ours

pytestmark = pytest.mark.gpu
BLOCK = 16


def _prefill(ours: DecoderForCausalLM, prompts: list[torch.Tensor]) -> tuple[torch.Tensor, list[list[int]]]:
    """Prompts' KV into a fresh cache bound to ``ours``; returns (the cache, block tables)."""
    cfg, lens = ours.config, [len(p) for p in prompts]
    per = [-(-(n + 1) // BLOCK) for n in lens]                  # room for the decoded token
    kv = torch.zeros(sum(per), cfg.num_hidden_layers, 2, BLOCK, cfg.num_key_value_heads, cfg.head_dim,
                     dtype=torch.bfloat16, device="cuda")
    for i, layer in enumerate(ours.layers):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = kv[:, i, 0], kv[:, i, 1]
    perm = torch.randperm(sum(per)).tolist()
    tables, start = [], 0
    for nb in per:
        tables.append(perm[start:start + nb] + [-1] * (max(per) - nb))
        start += nb
    slots = [tables[b][p // BLOCK] * BLOCK + p % BLOCK for b, n in enumerate(lens) for p in range(n)]
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0).to(torch.int32)
    ctx = ForwardContext(is_prefill=True, slot_mapping=torch.tensor(slots, dtype=torch.int32, device="cuda"),
                         context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                         block_tables=torch.tensor(tables, dtype=torch.int32, device="cuda"), cu_seqlens_q=cu,
                         max_seqlen_q=max(lens))
    with torch.inference_mode(), forward_context(ctx):
        ours(torch.cat(prompts), torch.cat([torch.arange(n, device="cuda") for n in lens]))
    return kv, tables


@pytest.mark.parametrize("batch", [1, 8, 16, 32, 64, 256])           # 64, 256: the Gluon range
def test_decode_logits_match_hf_through_the_chain(monkeypatch, batch):
    hf, ours = hf_and_ours()
    gen = torch.Generator().manual_seed(batch)
    lens = [int(n) for n in torch.randint(5, 300, (batch,), generator=gen)]
    prompts = [torch.randint(0, 150000, (n,), generator=gen).cuda() for n in lens]
    nxt = torch.randint(0, 150000, (batch,), generator=gen).cuda()
    with torch.inference_mode():
        ref = torch.stack([hf(torch.cat([p, nxt[i:i + 1]])[None]).logits[0, -1] for i, p in enumerate(prompts)]).float()
    results = {}
    monkeypatch.setenv("PDSERVE_DATAFLOW_WIDE", "1")
    for flag in ("0", "1"):
        monkeypatch.setenv("PDSERVE_DATAFLOW_DECODE", flag)
        kv, tables = _prefill(ours, prompts)
        slots = [tables[b][n // BLOCK] * BLOCK + n % BLOCK for b, n in enumerate(lens)]
        ctx = ForwardContext(is_prefill=False, slot_mapping=torch.tensor(slots, dtype=torch.int32, device="cuda"),
                             context_lens=torch.tensor([n + 1 for n in lens], dtype=torch.int32, device="cuda"),
                             block_tables=torch.tensor(tables, dtype=torch.int32, device="cuda"),
                             max_context_len=max(lens) + 1)
        positions = torch.tensor(lens, device="cuda")
        with torch.inference_mode(), forward_context(ctx):
            wide_ok = batch <= dataflow_decode.MAX_ROWS or dataflow_decode.wide_available(nxt.device)
            assert dataflow_decode.applies(ours, nxt) == (flag == "1" and pdl_available(nxt.device) and wide_ok)
            hidden = ours(nxt, positions)
            if flag == "1":                       # the same forward captured and replayed in a graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    replayed = ours(nxt, positions)
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(replayed, hidden)
            logits = ours.compute_logits(hidden).float()
        rel = ((logits - ref).norm() / ref.norm()).item()
        top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
        results[flag] = (rel, top1)
    print(f"batch {batch}: usual forward rel {results['0'][0]:.2e} top-1 {results['0'][1]:.2f}; "
          f"chain rel {results['1'][0]:.2e} top-1 {results['1'][1]:.2f}")
    (rel_usual, top1_usual), (rel_chain, top1_chain) = results["0"], results["1"]
    assert rel_chain < 3e-2 and rel_chain < 1.5 * rel_usual + 1e-3      # no further from HF than the usual path
    if batch > 1:                                                   # random weights: near ties flip a few
        assert top1_chain >= min(0.85, top1_usual - 0.2)


@pytest.mark.parametrize("B,splits", [(5, 1), (5, 4), (64, 4)])       # (64, 4): more than 3 programs an SM
def test_qk_norm_rope_then_attention_with_pdl_in_a_graph_match_plain_launches(B, splits):
    """The two kernels back to back (K/V stored by the first, read by the second), PDL-launched
    inside a CUDA graph and replayed, against plain launches: the same output and cache."""
    from pdserve.common.layers.rotary import RotaryEmbedding
    from pdserve.common.ops.fused import qk_norm_rope
    from pdserve.common.ops.paged_attention import alloc_decode_workspace, paged_attention_decode
    from pdserve.common.ops.pdl import pdl_available
    if not pdl_available(torch.device("cuda")):
        pytest.skip("no programmatic dependent launch on this GPU")
    torch.manual_seed(B + splits)
    Hq, Hkv, D, nb = 16, 8, 128, 8 * B
    kv = torch.randn(2, nb, BLOCK, Hkv, D, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(nb, device="cuda")[:B * 8].view(B, 8).to(torch.int32)
    lens = torch.randint(1, 8 * BLOCK + 1, (B,), dtype=torch.int32, device="cuda")
    pos = lens.long() - 1
    slots = (tables.gather(1, (pos // BLOCK)[:, None]).squeeze(1) * BLOCK + pos % BLOCK).to(torch.int32)
    rot = RotaryEmbedding(D, 4096, 1e6).to("cuda")
    qkv = torch.randn(B, (Hq + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
    qw, kw = (1 + 0.1 * torch.randn(D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ws = alloc_decode_workspace(B, Hq, D, 4, "cuda")

    def step(cache: torch.Tensor, out: torch.Tensor, pdl: bool) -> None:
        q, _, _ = qk_norm_rope(qkv, pos, rot.cos_cache, rot.sin_cache, Hq, Hkv, D, qw, kw, 1e-6,
                               cache[0], cache[1], slots, pdl=pdl)
        paged_attention_decode(q, cache[0], cache[1], tables, lens, D ** -0.5, out=out, workspace=ws,
                               num_splits=splits, pdl=pdl)
    plain_kv, plain = kv.clone(), torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    step(plain_kv, plain, False)
    chained_kv, chained = kv.clone(), torch.full_like(plain, float("nan"))
    step(chained_kv, chained, True)                                      # compile, and eager
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(chained_kv, chained, True)
    for _ in range(3):
        chained.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(chained, plain) and torch.equal(chained_kv, plain_kv)
