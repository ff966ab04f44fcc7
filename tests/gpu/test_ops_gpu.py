"""Triton paged-attention / KV-store kernels vs the torch references on CUDA (bf16 and fp32).

Larger shapes than tests/unit/test_ops.py: batch 64, contexts up to 2k, Qwen3-0.6B geometry
(16 q heads, 8 kv heads, head_dim 128) and SmolLM2's (9 q / 3 kv heads, head_dim 64), the cache
laid out as in docs/design.md (one tensor [num_blocks, layers, 2, block_size, Hkv, D]).
Outputs are poisoned with NaN first so every element must be written. Relative error
||out - ref|| / ||ref|| must be < 1e-2 (bf16) / < 1e-3 (fp32). Skipped without CUDA.
"""
import os
import zlib

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

triton = pytest.importorskip("triton")


if torch.cuda.is_available():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: kernels would not be compiled", allow_module_level=True)
    from pdserve.common.ops import kv_store, paged_attention, paged_attention_prefill  # noqa: E402
    from pdserve.common.ops.reference import (  # noqa: E402
        paged_attention_decode_ref,
        paged_attention_prefill_ref,
        store_kvcache_ref,
    )

DEV = "cuda"
NUM_LAYERS = 4
LAYER = 2
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-3}
GEOMETRIES = {            # (Hq, Hkv, D)
    "qwen3": (16, 8, 128),
    "smollm2": (9, 3, 64),
    "mha64": (4, 4, 64),
}


def seed_of(*parts) -> int:
    """Deterministic per-case seed (Python's str hash is salted per process)."""
    return zlib.crc32(repr(parts).encode()) % 100_000


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def make_cache(num_blocks, block_size, hkv, d, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, hkv, d, device=DEV, generator=g,
                     dtype=torch.float32).to(dtype)
    return kv, kv[:, LAYER, 0], kv[:, LAYER, 1]


def make_block_tables(context_lens, block_size, num_blocks, seed, extra_pad=2):
    g = torch.Generator().manual_seed(seed)
    need = [-(-c // block_size) for c in context_lens]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=g)
    bt = torch.full((len(context_lens), max(need) + extra_pad), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[pos:pos + n].to(torch.int32)
        pos += n
    return bt.to(DEV)


def random_contexts(batch, max_ctx, block_size, seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (batch,), generator=g).tolist()
    # boundaries and tiny contexts
    special = [max_ctx, 1, 2, block_size - 1, block_size, block_size + 1, 2 * block_size]
    for i, c in enumerate(special[:batch]):
        ctx[i] = c
    return ctx


# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kvcache_gpu(dtype, block_size):
    hq, hkv, d = GEOMETRIES["qwen3"]
    num_blocks, n = 300, 4000
    kv = torch.full((num_blocks, NUM_LAYERS, 2, block_size, hkv, d), float("nan"), device=DEV, dtype=dtype)
    g = torch.Generator(device=DEV).manual_seed(7 + block_size)
    fused = torch.randn(n, (hq + 2 * hkv) * d, device=DEV, generator=g).to(dtype)
    key = fused[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
    value = fused[:, (hq + hkv) * d:].view(n, hkv, d)
    slots = torch.randperm(num_blocks * block_size, device=DEV, generator=g)[:n].to(torch.int32)
    slots[::7] = -1
    expect = kv.clone()
    store_kvcache_ref(key, value, expect[:, LAYER, 0], expect[:, LAYER, 1], slots)
    kv_store.store_kvcache(key, value, kv[:, LAYER, 0], kv[:, LAYER, 1], slots)
    torch.cuda.synchronize()
    torch.testing.assert_close(kv, expect, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("geometry", ["qwen3", "smollm2", "mha64"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch,max_ctx,num_splits", [(64, 2048, None), (3, 2048, None),
                                                       (64, 700, 3), (1, 4096, None)])
def test_decode_gpu(dtype, geometry, block_size, batch, max_ctx, num_splits):
    hq, hkv, d = GEOMETRIES[geometry]
    seed = seed_of(str(dtype), geometry, block_size, batch, max_ctx, num_splits)
    ctx = random_contexts(batch, max_ctx, block_size, seed)
    num_blocks = sum(-(-c // block_size) for c in ctx) + 8
    kv, kc, vc = make_cache(num_blocks, block_size, hkv, d, dtype, seed)
    bt = make_block_tables(ctx, block_size, num_blocks, seed)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    # q as a strided slice of a fused qkv output
    qkv = torch.randn(batch, (hq + 2 * hkv) * d, device=DEV, generator=g).to(dtype)
    q = qkv[:, :hq * d].view(batch, hq, d)
    scale = d ** -0.5
    out = torch.full((batch, hq, d), float("nan"), device=DEV, dtype=dtype)
    res = paged_attention.paged_attention_decode(q, kc, vc, bt, cl, scale, out=out,
                                                 num_splits=num_splits)
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, scale)
    assert res.data_ptr() == out.data_ptr() and res.dtype == dtype
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)
    # per-sequence too (a wrong short sequence would hide in the global norm)
    per_seq = ((out.float() - ref.float()).flatten(1).norm(dim=1) / ref.float().flatten(1).norm(dim=1))
    assert per_seq.max().item() < 3 * TOL[dtype], per_seq.max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("geometry", ["qwen3", "smollm2"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("case", ["fresh", "prefix", "chunks"])
def test_prefill_gpu(dtype, geometry, block_size, case):
    hq, hkv, d = GEOMETRIES[geometry]
    seed = seed_of(str(dtype), geometry, block_size, case)
    g = torch.Generator().manual_seed(seed)
    if case == "fresh":        # no cached prefix, ragged
        q_lens = torch.randint(1, 700, (8,), generator=g).tolist() + [1, 128, 129]
        ctx = list(q_lens)
    elif case == "prefix":     # cached prefixes up to 1.5k
        q_lens = torch.randint(1, 512, (8,), generator=g).tolist() + [1, 64]
        ctx = [q + int(torch.randint(0, 1500, (1,), generator=g)) for q in q_lens]
    else:                      # chunked prefill: short chunks behind long contexts, one empty
        q_lens = [16, 1, 0, 33, 256]
        ctx = [2048, 1000, 77, 513, 256]
    num_blocks = sum(-(-c // block_size) for c in ctx) + 8
    kv, kc, vc = make_cache(num_blocks, block_size, hkv, d, dtype, seed)
    bt = make_block_tables(ctx, block_size, num_blocks, seed)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    T = sum(q_lens)
    gq = torch.Generator(device=DEV).manual_seed(seed + 1)
    q = torch.randn(T, hq, d, device=DEV, generator=gq).to(dtype)
    scale = d ** -0.5
    out = torch.full_like(q, float("nan"))
    paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, max(q_lens), scale, out=out)
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, max(q_lens), scale)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) < TOL[dtype], rel_err(out, ref)


def test_decode_cuda_graph():
    """Capture decode with preallocated out/workspace and fixed num_splits; replay on new data."""
    hq, hkv, d = GEOMETRIES["qwen3"]
    dtype, block_size, max_batch, max_blocks = torch.bfloat16, 16, 32, 64
    num_blocks = max_batch * max_blocks
    kv, kc, vc = make_cache(num_blocks, block_size, hkv, d, dtype, 5)
    q = torch.zeros(max_batch, hq, d, device=DEV, dtype=dtype)
    bt = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=DEV)
    cl = torch.zeros(max_batch, dtype=torch.int32, device=DEV)
    out = torch.empty(max_batch, hq, d, device=DEV, dtype=dtype)
    splits = 4
    ws = paged_attention.alloc_decode_workspace(max_batch, hq, d, splits, DEV)
    fn = lambda: paged_attention.paged_attention_decode(  # noqa: E731
        q, kc, vc, bt, cl, 0.088, out=out, workspace=ws, num_splits=splits)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()                                  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for seed in (1, 2):
        batch = 20                            # rows past the live batch are padding (context 0)
        ctx = random_contexts(batch, max_blocks * block_size, block_size, seed)
        bt.copy_(_padded_tables(ctx, block_size, num_blocks, seed, max_batch, max_blocks))
        cl.zero_()
        cl[:batch] = torch.tensor(ctx, dtype=torch.int32, device=DEV)
        q_gen = torch.Generator(device=DEV).manual_seed(seed)
        q.copy_(torch.randn(max_batch, hq, d, device=DEV, generator=q_gen).to(dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = paged_attention_decode_ref(q, kc, vc, bt, cl, 0.088)
        assert not torch.isnan(out).any()
        assert torch.all(out[batch:] == 0)
        assert rel_err(out[:batch], ref[:batch]) < 1e-2


def _padded_tables(ctx, block_size, num_blocks, seed, max_batch, max_blocks):
    tables = make_block_tables(ctx, block_size, num_blocks, seed, extra_pad=0)
    full = torch.full((max_batch, max_blocks), -1, dtype=torch.int32, device=DEV)
    full[:tables.shape[0], :tables.shape[1]] = tables
    return full


def test_end_to_end_store_prefill_decode_gpu():
    """Store a prompt in pieces, prefill in two chunks, decode one token: all against refs."""
    hq, hkv, d = GEOMETRIES["qwen3"]
    dtype, bs = torch.bfloat16, 16
    n = 300
    kv = torch.zeros(64, NUM_LAYERS, 2, bs, hkv, d, device=DEV, dtype=dtype)
    kc, vc = kv[:, LAYER, 0], kv[:, LAYER, 1]
    blocks = torch.randperm(64, generator=torch.Generator().manual_seed(3))[:-(-(n + 1) // bs)]
    bt = blocks.to(torch.int32).to(DEV)[None]
    slots = (blocks[torch.arange(n + 1) // bs] * bs + torch.arange(n + 1) % bs).to(torch.int32).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(4)
    k = torch.randn(n + 1, hkv, d, device=DEV, generator=g).to(dtype)
    v = torch.randn(n + 1, hkv, d, device=DEV, generator=g).to(dtype)
    q = torch.randn(n + 1, hq, d, device=DEV, generator=g).to(dtype)
    scale = d ** -0.5
    outs = []
    for lo, hi in ((0, 200), (200, n)):                       # chunked prefill
        kv_store.store_kvcache(k[lo:hi], v[lo:hi], kc, vc, slots[lo:hi])
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEV)
        cl = torch.tensor([hi], dtype=torch.int32, device=DEV)
        outs.append(paged_attention_prefill.paged_attention_prefill(q[lo:hi], kc, vc, cu, cl, bt, hi - lo, scale))
    kv_store.store_kvcache(k[n:], v[n:], kc, vc, slots[n:])
    dec = paged_attention.paged_attention_decode(q[n:], kc, vc, bt,
                                                 torch.tensor([n + 1], dtype=torch.int32, device=DEV), scale)
    full = paged_attention_prefill_ref(q, kc, vc, torch.tensor([0, n + 1], dtype=torch.int32, device=DEV),
                                       torch.tensor([n + 1], dtype=torch.int32, device=DEV), bt, n + 1, scale)
    got = torch.cat(outs + [dec])
    assert rel_err(got, full) < 1e-2
