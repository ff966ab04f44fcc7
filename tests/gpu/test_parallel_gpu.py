"""Tensor parallelism on two GPUs over NCCL: each sharded layer (and a whole decoder layer stack,
bf16) against the unsharded one on fresh random weights (ranks as threads of this process,
eager); and the engine at TP2 (rank processes, decode and mixed-step graphs captured with their
all-reduces, replayed on every rank) giving TP1's greedy tokens on a tiny fp32 model. (A graph
captured in two threads of one process hung on H100s: the captures are tested the way the engine
makes them, one process a rank. Loading a compiled Triton kernel onto a GPU from two threads at
once aborted the process on H100s too: the threads load kernels one at a time, :func:`_one_loader`.)"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from pdserve.common.config import ModelConfig
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.models.decoder import DecoderForCausalLM
from pdserve.common.parallel import RankGroup, split_evenly
from pdserve.common.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.common.parallel.linear import ColumnParallelLinear, RowParallelLinear
from tests.rank_threads import run_in_threads

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


@pytest.fixture(autouse=True)
def _one_loader() -> Iterator[None]:
    """Triton's CompiledKernel._init_handles (a kernel's first launch on a device loads its
    module) under one lock for the test, so rank threads never load at the same time."""
    from triton.compiler.compiler import CompiledKernel
    lock, load = threading.RLock(), CompiledKernel._init_handles

    def locked(self):
        with lock:
            return load(self)
    CompiledKernel._init_handles = locked
    yield
    CompiledKernel._init_handles = load


def run_ranks(fn: Callable[[RankGroup], object], size: int = 2) -> list:
    """``fn(group)`` on GPUs 0..size-1, one thread each, over one NCCL group."""
    store = dist.HashStore()

    def work(rank: int) -> object:
        torch.cuda.set_device(rank)
        result = fn(RankGroup.create(store, rank, size, torch.device("cuda", rank), 120.0))
        torch.cuda.synchronize()
        return result

    return run_in_threads(size, work, join_s=300)


def _fresh(*shape: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))) * 0.05).to(dtype)


def test_sharded_linears_and_vocab_match_unsharded():
    hidden, q, kv, vocab, tokens = 1024, 2048, 512, 3001, 37
    w_qkv, w_o, emb = _fresh(q + 2 * kv, hidden), _fresh(hidden, q), _fresh(vocab, hidden)
    x = _fresh(tokens, hidden)
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1))
    ref_qkv = (x.cuda() @ w_qkv.cuda().T)
    ref_o = ref_qkv[:, :q] @ w_o.cuda().T
    ref_emb, ref_logits = emb.cuda()[ids.cuda()], x.cuda() @ emb.cuda().T

    def rank(g: RankGroup):
        dev = g.device
        qr, kr = split_evenly(q, 2, g.rank), split_evenly(kv, 2, g.rank)
        with torch.device(dev):
            col = ColumnParallelLinear(hidden, [q, kv, kv], [qr, kr, kr], False, g).to(torch.bfloat16)
            row = RowParallelLinear(q, hidden, qr, False, g).to(torch.bfloat16)
            e = VocabParallelEmbedding(vocab, hidden, g).to(torch.bfloat16)
            head = ParallelLMHead(vocab, hidden, g).to(torch.bfloat16)
        col.load_shard("weight", w_qkv.to(dev))
        row.load_shard("weight", w_o.to(dev))
        e.load_shard("weight", emb.to(dev))
        head.weight = e.weight
        local = col(x.to(dev))
        n = qr[1] - qr[0]
        return (local[:, :n].cpu(), row(local[:, :n].contiguous()).cpu(), e(ids.to(dev)).cpu(),
                head(x.to(dev)).cpu())

    for g, (qkv, o, e, logits) in enumerate(run_ranks(rank)):
        qr = split_evenly(q, 2, g)
        torch.testing.assert_close(qkv, ref_qkv[:, qr[0]:qr[1]].cpu(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(o, ref_o.cpu(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(e, ref_emb.cpu())
        torch.testing.assert_close(logits, ref_logits.cpu(), atol=3e-2, rtol=3e-2)


def test_decoder_bf16_shards_match_unsharded():
    """Qwen3-32B's head layout (64 query / 8 KV heads of 128) on 2 layers of hidden 1024: the
    prefill logits of the TP2 model equal the one-GPU model's (bf16 tolerance)."""
    cfg = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 1024,
                                    "intermediate_size": 2560, "num_hidden_layers": 2, "num_attention_heads": 64,
                                    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 512})
    from tests.unit.test_parallel_layers import _prefill
    torch.manual_seed(0)
    full = DecoderForCausalLM(cfg).double()
    for p in full.parameters():
        p.data.normal_(0, 0.05)
    tokens = torch.randint(0, 4096, (40,))
    want = _prefill(full, tokens).float()
    state = {k: v.to(torch.bfloat16) for k, v in full.state_dict().items()}

    def rank(g: RankGroup):
        with torch.device(g.device):
            model = DecoderForCausalLM(cfg, "torch", g).to(torch.bfloat16)
        for name, _ in model.named_parameters():
            model.load_param(name, state[name].to(g.device))
        cache_dtype = torch.bfloat16
        logits = _prefill_on(model, tokens.to(g.device), cache_dtype)
        return logits.float().cpu()

    for logits in run_ranks(rank):
        assert (logits.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
        torch.testing.assert_close(logits, want, atol=0.1, rtol=0.1)


def _prefill_on(model: DecoderForCausalLM, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from pdserve.common.context import ForwardContext, forward_context
    n, bs, dev = tokens.shape[0], 16, tokens.device
    blocks = -(-n // bs)
    for attn in model.attention_layers():
        attn.k_cache = torch.zeros(blocks, bs, attn.num_kv_heads, attn.head_dim, dtype=dtype, device=dev)
        attn.v_cache = torch.zeros_like(attn.k_cache)
    i32 = torch.int32
    ctx = ForwardContext(is_prefill=True, slot_mapping=torch.arange(n, dtype=i32, device=dev),
                         context_lens=torch.tensor([n], dtype=i32, device=dev),
                         block_tables=torch.arange(blocks, dtype=i32, device=dev)[None],
                         cu_seqlens_q=torch.tensor([0, n], dtype=i32, device=dev), max_seqlen_q=n)
    with forward_context(ctx), torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(n, device=dev)))


@pytest.mark.parametrize("eager", [False, True])
def test_engine_tp2_equals_tp1_with_graphs(eager):
    prompts = [[(7 * i + 3 * j) % 500 + 3 for j in range(5 + 23 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = dict(device="cuda", dtype="float32", num_kv_blocks=128, enforce_eager=eager, max_num_batched_tokens=64)
    with LLM("tiny-llama", **engine) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM("tiny-llama", tensor_parallel_size=2, **engine) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        counts = dict(llm.engine.model_runner.leader.counts)
    assert got == want
    if not eager:
        assert counts.get("decode_graph", 0) > 0, counts           # decode steps replayed with their all-reduces
