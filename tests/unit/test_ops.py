"""Triton paged-attention / KV-store kernels vs their torch references.

On a machine without CUDA the kernels run on the CPU under the Triton interpreter
(TRITON_INTERPRET=1, set here before Triton is imported) in fp32. On a CUDA machine (where the
interpreter is not forced) the same checks run compiled on the GPU. The references are checked
against a dumb per-token loop on small cases.
"""
import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton decorates the kernels (i.e. before pdserve.common.ops.* is imported).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")


from pdserve.common.ops import kv_store, paged_attention, paged_attention_prefill  # noqa: E402
from pdserve.common.ops.reference import (  # noqa: E402
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    store_kvcache_ref,
)


def _interpreted() -> bool:
    return type(paged_attention._decode_split_kernel).__name__ == "InterpretedFunction"


INTERPRETED = _interpreted()
if INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    # Triton was imported by an earlier module before TRITON_INTERPRET was set (it is read when
    # triton and its standard library are decorated, so re-importing our modules is not enough).
    pytest.skip("Triton imported without TRITON_INTERPRET=1 and no CUDA device: run with "
                "TRITON_INTERPRET=1", allow_module_level=True)

RTOL, ATOL = 1e-4, 1e-5
NUM_LAYERS = 3
LAYER = 1


# ------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------

def make_cache(num_blocks, block_size, hkv, d, gen, dtype=torch.float32):
    """Per-worker cache [num_blocks, layers, 2, bs, Hkv, D]; returns (kv, k_cache, v_cache)."""
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, hkv, d, generator=gen).to(dtype)
    kv = kv.to(DEVICE)
    return kv, kv[:, LAYER, 0], kv[:, LAYER, 1]


def make_block_tables(context_lens, block_size, num_blocks, gen, extra_pad=1):
    """Random distinct blocks per sequence; rows padded with -1 (at least `extra_pad` columns)."""
    need = [-(-c // block_size) for c in context_lens]
    max_blocks = max(need) + extra_pad
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    assert sum(need) <= num_blocks
    bt = torch.full((len(context_lens), max_blocks), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[pos:pos + n], dtype=torch.int32)
        pos += n
    return bt.to(DEVICE)


def paged_case(block_size, hkv, d, context_lens, seed, spare_blocks):
    """One parametrized case's paged KV: (gen, k_cache, v_cache, block tables, context lens),
    the cache ``spare_blocks`` larger than the sequences need; ``gen`` (seeded with ``seed``)
    goes on to draw the queries."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + spare_blocks
    _, kc, vc = make_cache(num_blocks, block_size, hkv, d, gen)
    bt = make_block_tables(context_lens, block_size, num_blocks, gen)
    return gen, kc, vc, bt, torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)


def strided_q(rows, hq, hkv, d, gen):
    """q [rows, Hq, D] as a strided slice of a fused qkv projection output, as in the model."""
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(DEVICE)
    return qkv[:, :hq * d].view(rows, hq, d)


def loop_attention(q_rows, positions, seq_of_row, k_cache, v_cache, block_tables, scale):
    """Dumb per-token, per-head loop: row r attends to keys 0..positions[r] of its sequence."""
    _, bs, hkv, d = k_cache.shape
    hq = q_rows.shape[1]
    g = hq // hkv
    out = torch.zeros(q_rows.shape, dtype=torch.float64)
    for r in range(q_rows.shape[0]):
        b, p = seq_of_row[r], positions[r]
        for h in range(hq):
            scores, vals = [], []
            for j in range(p + 1):
                blk = int(block_tables[b, j // bs])
                k = k_cache[blk, j % bs, h // g].double().cpu()
                vals.append(v_cache[blk, j % bs, h // g].double().cpu())
                scores.append(float(q_rows[r, h].double().cpu() @ k) * scale)
            m = max(scores)
            w = [pow(2.718281828459045, s - m) for s in scores]
            tot = sum(w)
            out[r, h] = sum(wi * vi for wi, vi in zip(w, vals)) / tot
    return out


def assert_close(out, ref):
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------------------------------
# references vs the per-token loop
# ------------------------------------------------------------------------------------------

def test_references_match_loop():
    gen = torch.Generator().manual_seed(1234)
    bs, hkv, g, d = 4, 2, 3, 16
    hq = hkv * g
    ctx = [1, 6, 9]
    q_lens = [1, 3, 9]
    kv, kc, vc = make_cache(12, bs, hkv, d, gen)
    bt = make_block_tables(ctx, bs, 12, gen)
    scale = d ** -0.5

    # decode
    q = torch.randn(len(ctx), hq, d, generator=gen).to(DEVICE)
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, scale)
    loop = loop_attention(q, [c - 1 for c in ctx], list(range(len(ctx))), kc, vc, bt, scale)
    torch.testing.assert_close(ref.double().cpu(), loop, rtol=1e-5, atol=1e-6)

    # prefill with a cached prefix (ctx > q_len for sequence 1)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=gen).to(DEVICE)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEVICE)
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, max(q_lens), scale)
    positions, seqs = [], []
    for b, (n, c) in enumerate(zip(q_lens, ctx)):
        positions += [c - n + i for i in range(n)]
        seqs += [b] * n
    loop = loop_attention(q, positions, seqs, kc, vc, bt, scale)
    torch.testing.assert_close(ref.double().cpu(), loop, rtol=1e-5, atol=1e-6)


def test_store_ref_matches_loop():
    gen = torch.Generator().manual_seed(99)
    bs, hkv, d, n = 4, 2, 8, 7
    kv, kc, vc = make_cache(5, bs, hkv, d, gen)
    key = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    value = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    slots = torch.tensor([3, -1, 0, 19, 8, -1, 12], dtype=torch.int32, device=DEVICE)
    expect = kv.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // bs, LAYER, 0, s % bs] = key[i]
            expect[s // bs, LAYER, 1, s % bs] = value[i]
    store_kvcache_ref(key, value, kc, vc, slots)
    assert torch.equal(kv, expect)


# ------------------------------------------------------------------------------------------
# store_kvcache
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size,hkv,d,seed", [(16, 2, 64, 0), (32, 3, 64, 1), (16, 1, 128, 2)])
def test_store_kvcache(block_size, hkv, d, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks, n = 6, 23
    kv = torch.full((num_blocks, NUM_LAYERS, 2, block_size, hkv, d), float("nan"), device=DEVICE)
    kc, vc = kv[:, LAYER, 0], kv[:, LAYER, 1]
    # key/value as strided slices of a fused projection output (token stride != Hkv*D)
    fused = torch.randn(n, 3 * hkv * d, generator=gen).to(DEVICE)
    key = fused[:, hkv * d:2 * hkv * d].view(n, hkv, d)
    value = fused[:, 2 * hkv * d:].view(n, hkv, d)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n].to(torch.int32)
    slots[torch.tensor([0, 5, 11, 22])] = -1                    # padding
    slots = slots.to(DEVICE)
    expect = kv.clone()
    store_kvcache_ref(key, value, expect[:, LAYER, 0], expect[:, LAYER, 1], slots)
    kv_store.store_kvcache(key, value, kc, vc, slots)
    # exact, NaN poison untouched everywhere else (other slots, other layers)
    torch.testing.assert_close(kv, expect, rtol=0, atol=0, equal_nan=True)
    assert int(torch.isnan(kv[:, LAYER]).logical_not().sum()) == 2 * (n - 4) * hkv * d


# ------------------------------------------------------------------------------------------
# decode
# ------------------------------------------------------------------------------------------

DECODE_CASES = [
    # block_size, hkv, group, d, context lens, num_splits, seed
    (16, 2, 1, 64, [1, 16, 17, 33, 64], None, 10),
    (32, 1, 2, 128, [1, 31, 32, 33, 70], 1, 11),
    (16, 3, 3, 64, [5, 48, 49, 100], 3, 12),
    (32, 2, 3, 128, [1, 65, 130], 4, 13),
    (64, 1, 2, 64, [63, 64, 65, 200], 2, 14),
    (16, 1, 2, 64, [300], None, 15),                              # heuristic picks > 1 split
]


@pytest.mark.parametrize("block_size,hkv,group,d,ctx,num_splits,seed", DECODE_CASES)
def test_paged_attention_decode(block_size, hkv, group, d, ctx, num_splits, seed):
    hq = hkv * group
    gen, kc, vc, bt, cl = paged_case(block_size, hkv, d, ctx, seed, spare_blocks=3)
    q = strided_q(len(ctx), hq, hkv, d, gen)
    scale = d ** -0.5
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, scale)
    if num_splits is None:
        assert paged_attention.decode_num_splits(
            len(ctx), hkv, bt.shape[1] * block_size, DEVICE) == (2 if seed == 15 else 1)
    out = paged_attention.paged_attention_decode(q, kc, vc, bt, cl, scale, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref)


def test_paged_attention_decode_preallocated():
    """CUDA-graph style call: poisoned out / workspace larger than needed, fixed num_splits,
    a padding row with context 0 (gets zeros)."""
    gen = torch.Generator().manual_seed(21)
    bs, hkv, group, d = 16, 2, 2, 64
    hq = hkv * group
    ctx = [40, 0, 17, 1]
    num_blocks = 10
    kv, kc, vc = make_cache(num_blocks, bs, hkv, d, gen)
    bt = make_block_tables([max(c, 1) for c in ctx], bs, num_blocks, gen)
    bt[1] = -1
    cl = torch.tensor(ctx, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(ctx), hq, d, generator=gen).to(DEVICE)
    scale = 0.1
    out_buf = torch.full((8, hq, d), float("nan"), device=DEVICE)
    ws = paged_attention.alloc_decode_workspace(8, hq, d, 4, DEVICE).fill_(float("nan"))
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, scale)
    assert torch.all(ref[1] == 0)
    for splits in (3, 1):
        out_buf.fill_(float("nan"))
        out = paged_attention.paged_attention_decode(q, kc, vc, bt, cl, scale, out=out_buf,
                                                     workspace=ws, num_splits=splits)
        assert out.data_ptr() == out_buf.data_ptr() and out.shape == q.shape
        assert_close(out, ref)
        assert torch.isnan(out_buf[len(ctx):]).all()            # rows past B untouched


def test_decode_num_splits_heuristic():
    f = paged_attention.decode_num_splits
    assert f(256, 8, 600, "cpu") == 1
    assert f(1, 8, 64, "cpu") == 1                               # short context: no split
    assert 1 < f(1, 1, 4096, "cpu") <= paged_attention.DECODE_MAX_SPLITS
    assert f(1, 1, 4096, "cpu", max_splits=3) == 3


# ------------------------------------------------------------------------------------------
# prefill
# ------------------------------------------------------------------------------------------

PREFILL_CASES = [
    # block_size, hkv, group, d, q_lens, context lens, seed
    (16, 2, 1, 64, [5, 17, 33], [5, 17, 33], 30),               # no prefix
    (16, 1, 3, 64, [7, 20, 1], [40, 20, 18], 31),                # cached prefixes, 1-token chunk
    (32, 2, 2, 128, [33, 9, 0, 4], [70, 9, 12, 35], 32),         # a zero-length sequence
    (32, 1, 1, 128, [40], [100], 33),
    (16, 2, 3, 128, [3, 26, 16], [19, 26, 50], 34),
    (32, 3, 2, 64, [64, 2], [64, 97], 35),
]


@pytest.mark.parametrize("block_size,hkv,group,d,q_lens,ctx,seed", PREFILL_CASES)
def test_paged_attention_prefill(block_size, hkv, group, d, q_lens, ctx, seed):
    hq = hkv * group
    gen, kc, vc, bt, cl = paged_case(block_size, hkv, d, ctx, seed, spare_blocks=2)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    T = sum(q_lens)
    q = strided_q(T, hq, hkv, d, gen)
    scale = d ** -0.5
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, max(q_lens), scale)
    out = torch.full((T, hq, d), float("nan"), device=DEVICE)
    res = paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, max(q_lens), scale, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert not torch.isnan(out).any()                            # every row written
    assert_close(out, ref)


def test_store_then_prefill_then_decode():
    """End to end on one sequence: store the prompt, prefill, store one token, decode; the
    decode output of the last prompt position equals the prefill output of that row."""
    gen = torch.Generator().manual_seed(40)
    bs, hkv, group, d, n = 16, 2, 2, 64, 21
    hq = hkv * group
    kv = torch.zeros(4, NUM_LAYERS, 2, bs, hkv, d, device=DEVICE)
    kc, vc = kv[:, LAYER, 0], kv[:, LAYER, 1]
    bt = torch.tensor([[2, 0, -1]], dtype=torch.int32, device=DEVICE)
    slots = torch.tensor([2 * bs + i if i < bs else 0 * bs + i - bs for i in range(n)],
                         dtype=torch.int32, device=DEVICE)
    k = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    v = torch.randn(n, hkv, d, generator=gen).to(DEVICE)
    q = torch.randn(n, hq, d, generator=gen).to(DEVICE)
    kv_store.store_kvcache(k, v, kc, vc, slots)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEVICE)
    cl = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    pre = paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, n, 0.125)
    dec = paged_attention.paged_attention_decode(q[-1:], kc, vc, bt, cl, 0.125)
    assert_close(dec[0], pre[-1])
    assert_close(pre, paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, n, 0.125))
