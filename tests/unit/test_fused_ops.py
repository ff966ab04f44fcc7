"""Fused Triton elementwise kernels vs the layers' torch code (CPU: Triton interpreter, fp32)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pdserve.common.layers.norm import RMSNorm  # noqa: E402
from pdserve.common.layers.rotary import RotaryEmbedding  # noqa: E402
from pdserve.common.ops.fused import qk_norm_rope, rms_norm, silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _tol(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1)
    x = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    r = torch.randn(7, hidden, device=DEVICE, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), norm._norm(x), **_tol(dtype))
    out, res = rms_norm(x, norm.weight, 1e-6, r)
    torch.testing.assert_close(res, x + r, **_tol(dtype))
    torch.testing.assert_close(out, norm._norm(x + r), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 2 * 80, device=DEVICE, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(gate) * up, **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1)])
def test_qk_norm_rope_matches_layers(dtype, qk_norm, heads):
    torch.manual_seed(2)
    hq, hkv, d, T = heads[0], heads[1], 32, 6
    rot = RotaryEmbedding(d, 128, 10000.0).to(DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype)
    pos = torch.tensor([0, 5, 9, 17, 64, 127], device=DEVICE)
    qn, kn = RMSNorm(d, 1e-6).to(DEVICE, dtype), RMSNorm(d, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        qn.weight.normal_(1.0, 0.1)
        kn.weight.normal_(1.0, 0.1)
    q_ref, k_ref, v_ref = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q_ref, k_ref = q_ref.reshape(T, hq, d), k_ref.reshape(T, hkv, d)
    if qk_norm:
        q_ref, k_ref = qn._norm(q_ref), kn._norm(k_ref)
    q_ref, k_ref = rot(pos, q_ref, k_ref)
    q, k, v = qk_norm_rope(qkv, pos, rot.cos_cache, rot.sin_cache, hq, hkv, d,
                           qn.weight if qk_norm else None, kn.weight if qk_norm else None, 1e-6)
    torch.testing.assert_close(q, q_ref, **_tol(dtype))
    torch.testing.assert_close(k, k_ref, **_tol(dtype))
    torch.testing.assert_close(v, v_ref.reshape(T, hkv, d), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_stores_kv_like_store_kvcache(dtype):
    """The fused K/V store writes exactly what store_kvcache writes (padding slots skipped),
    into strided per-layer views of a pool, and leaves every other slot alone."""
    from pdserve.common.ops.kv_store import store_kvcache
    torch.manual_seed(3)
    hq, hkv, d, T, bs, nb = 4, 2, 32, 5, 4, 6
    rot = RotaryEmbedding(d, 64, 10000.0).to(DEVICE)
    qkv = torch.randn(T, (hq + 2 * hkv) * d, device=DEVICE, dtype=dtype)
    pos = torch.tensor([0, 3, 7, 12, 40], device=DEVICE)
    qw = torch.randn(d, device=DEVICE, dtype=dtype)
    kw = torch.randn(d, device=DEVICE, dtype=dtype)
    slots = torch.tensor([5, -1, 0, 23, 9], dtype=torch.int32, device=DEVICE)
    pools = [torch.full((nb, 2, 2, bs, hkv, d), float("nan"), device=DEVICE, dtype=dtype)
             for _ in range(2)]
    layer = 1
    kc, vc = pools[0][:, layer, 0], pools[0][:, layer, 1]
    q, k, v = qk_norm_rope(qkv, pos, rot.cos_cache, rot.sin_cache, hq, hkv, d, qw, kw, 1e-6,
                           kc, vc, slots)
    q2, k2, v2 = qk_norm_rope(qkv, pos, rot.cos_cache, rot.sin_cache, hq, hkv, d, qw, kw, 1e-6)
    torch.testing.assert_close(q, q2, rtol=0, atol=0)
    torch.testing.assert_close(k, k2, rtol=0, atol=0)
    store_kvcache(k2, v2, pools[1][:, layer, 0], pools[1][:, layer, 1], slots)
    torch.testing.assert_close(pools[0], pools[1], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("parts", [1, 2, 3])
@pytest.mark.parametrize("heads", [(4, 2), (6, 3)])
@pytest.mark.parametrize("store", [True, False])
def test_qk_norm_rope_adds_split_k_partials(parts, heads, store):
    """QKV given as fp32 split-K partials: the kernel adds them up and rounds to the model dtype,
    then computes exactly what it computes from the rounded sum (v written out, the cache too)."""
    torch.manual_seed(5)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    (hq, hkv), d, T, bs = heads, 32, 5, 4
    rot = RotaryEmbedding(d, 64, 10000.0).to(DEVICE)
    part = torch.randn(parts, T, (hq + 2 * hkv) * d, device=DEVICE)
    pos = torch.tensor([0, 3, 7, 12, 40], device=DEVICE)
    qw = 1 + 0.1 * torch.randn(d, device=DEVICE, dtype=dtype)
    kw = 1 + 0.1 * torch.randn(d, device=DEVICE, dtype=dtype)
    slots = torch.tensor([5, -1, 0, 23, 9], dtype=torch.int32, device=DEVICE)
    pools = [torch.full((6, 2, bs, hkv, d), float("nan"), device=DEVICE, dtype=dtype) for _ in range(2)]
    caches = [(p[:, 0], p[:, 1], slots) if store else (None, None, None) for p in pools]
    out = qk_norm_rope(part, pos, rot.cos_cache, rot.sin_cache, hq, hkv, d, qw, kw, 1e-6, *caches[0], dtype=dtype)
    ref = qk_norm_rope(part.sum(0).to(dtype), pos, rot.cos_cache, rot.sin_cache, hq, hkv, d, qw, kw, 1e-6,
                       *caches[1])
    for got, want in zip(out, ref):
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(pools[0], pools[1], rtol=0, atol=0, equal_nan=True)
    assert store or pools[0].isnan().all()                                   # no cache given: untouched
    with pytest.raises(AssertionError):
        qk_norm_rope(part, pos, rot.cos_cache, rot.sin_cache, hq, hkv, d, qw, kw, 1e-6)     # no dtype given


def test_temperature_sample_greedy_rows_and_distribution():
    from pdserve.common.ops.sampling import temperature_sample
    torch.manual_seed(3)
    V = 5000
    logits = torch.randn(4, V, device=DEVICE)
    temps = torch.tensor([0.0, 0.0, 1.0, 1.0], device=DEVICE)
    out = temperature_sample(logits, temps, seed=123)
    assert out[:2].tolist() == logits[:2].argmax(-1).tolist()
    # a 4-token distribution: empirical frequencies match softmax(logits / T)
    small = torch.tensor([[2.0, 1.0, 0.0, -1.0]], device=DEVICE).repeat(1000, 1)
    t = torch.full((1000,), 0.7, device=DEVICE)
    draws = temperature_sample(small, t, seed=7)
    freq = torch.bincount(draws.cpu(), minlength=4).float() / 1000
    expected = torch.softmax(small[0].cpu() / 0.7, -1)
    assert (freq - expected).abs().max() < 0.04
    assert not torch.equal(temperature_sample(small[:50], t[:50], 1), temperature_sample(small[:50], t[:50], 2))


def test_temperature_sample_across_vocabulary_chunks():
    """Rows longer than one chunk: greedy rows equal torch's argmax, a tie across chunks goes to
    the lowest index, and a sampled row can land in any chunk."""
    from pdserve.common.ops.sampling import CHUNK, temperature_sample
    torch.manual_seed(5)
    V = 2 * CHUNK + 1234
    logits = torch.randn(3, V, device=DEVICE)
    logits[2] = 0.0
    logits[2, CHUNK + 7] = logits[2, 2 * CHUNK + 5] = 9.0       # a tie in chunks 1 and 2
    greedy = torch.zeros(3, device=DEVICE)
    out = temperature_sample(logits, greedy, seed=11)
    assert out[:2].tolist() == logits[:2].argmax(-1).tolist()
    assert out[2].item() == CHUNK + 7
    favour = torch.zeros(3, V, device=DEVICE)
    for chunk in range(3):                                       # row j: all the mass in chunk j
        favour[chunk, :] = -30.0
        favour[chunk, chunk * CHUNK:(chunk + 1) * CHUNK] = 0.0
    draws = temperature_sample(favour, torch.ones(3, device=DEVICE), seed=3)
    assert [int(d) // CHUNK for d in draws] == [0, 1, 2] and int(draws.max()) < V


def test_temperature_sample_mass_spread_over_chunks():
    """One distribution over three chunks (masses 0.2 / 0.5 / 0.3 at T = 0.5, tokens inside a
    chunk uniform): the chunk and token frequencies of many rows match it."""
    from pdserve.common.ops.sampling import CHUNK, temperature_sample
    V, rows, T = 2 * CHUNK + 1234, 300, 0.5
    sizes = torch.tensor([CHUNK, CHUNK, V - 2 * CHUNK], dtype=torch.float64)
    mass = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    per_token = T * torch.log(mass / sizes)                      # logits / T = log p
    logits = torch.cat([per_token[c].repeat(int(sizes[c])) for c in range(3)]).float()
    draws = temperature_sample(logits.to(DEVICE).repeat(rows, 1), torch.full((rows,), T, device=DEVICE),
                               seed=17).cpu()
    assert draws.min() >= 0 and draws.max() < V
    freq = torch.bincount(draws // CHUNK, minlength=3).double() / rows
    assert (freq - mass).abs().max() < 0.08, freq          # ~3.4 sigma at 300 rows
    inside = draws[draws < CHUNK].double() / CHUNK               # uniform inside chunk 0
    assert abs(inside.mean().item() - 0.5) < 0.1
