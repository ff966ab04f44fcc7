"""FP8 on CUDA against the dequantized torch references, on fresh random inputs: the KV store
kernels' rounding of arbitrary values (the Triton interpreter cannot check it), decode and
prefill attention over bf16 queries and an FP8 cache, Fp8Linear's ``torch._scaled_mm`` at decode
and prefill row counts, Fp8BlockLinear's block-scaled ``torch._scaled_mm`` (1x128 activation and
128x128 weight scales) against its fp32 per-block reference, and the engine with both flags: CUDA
graphs equal eager, pools whole."""
from __future__ import annotations

import random

import pytest
import torch

from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.layers.fp8_block_linear import (
    Fp8BlockLinear,
    _quantize_groups_cuda,
    blockwise_mm_supported,
    fp8_block_linear_ref,
    quantize_act_groups,
)
from pdserve.common.layers.fp8_linear import Fp8Linear, fp8_linear_ref
from pdserve.common.ops import kv_store, paged_attention, paged_attention_prefill
from pdserve.common.ops.fp8 import FP8_DTYPE, per_row_scales, quantize_fp8
from pdserve.common.ops.fp8_quant import quantize_rows
from pdserve.common.ops.fused import qk_norm_rope
from pdserve.common.ops.reference import (
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    store_kvcache_ref,
)

pytestmark = pytest.mark.gpu
BS, HKV, G, D = 16, 8, 4, 128               # the Qwen3-8B attention geometry


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("scales", [(0.5, 2.0), (1.0, 1.0)])
def test_store_rounds_as_torch(scales):
    ks, vs = scales
    k = torch.randn(300, HKV, D, device="cuda", dtype=torch.bfloat16) * 20
    v = torch.randn(300, HKV, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(64 * BS, device="cuda")[:300].to(torch.int32)
    slots[::7] = -1
    caches = [torch.zeros(64, BS, HKV, D, dtype=FP8_DTYPE, device="cuda") for _ in range(4)]
    kv_store.store_kvcache(k, v, caches[0], caches[1], slots, k_scale=ks, v_scale=vs)
    store_kvcache_ref(k, v, caches[2], caches[3], slots, ks, vs)
    assert torch.equal(_bytes(caches[0]), _bytes(caches[2])) and torch.equal(_bytes(caches[1]), _bytes(caches[3]))


def test_fused_qk_norm_rope_stores_fp8_as_torch():
    T, HQ = 37, HKV * G
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 4000, (T,), device="cuda")
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device="cuda").float() / D))
    freqs = torch.outer(torch.arange(4096, device="cuda").float(), inv)
    cos, sin = torch.cat([freqs.cos()] * 2, -1).contiguous(), torch.cat([freqs.sin()] * 2, -1).contiguous()
    qw, kw = (torch.rand(D, device="cuda", dtype=torch.bfloat16) + 0.5 for _ in range(2))
    kc, vc = (torch.zeros(8, BS, HKV, D, dtype=FP8_DTYPE, device="cuda") for _ in range(2))
    slots = torch.randperm(8 * BS, device="cuda")[:T].to(torch.int32)
    _, k, v = qk_norm_rope(qkv, pos, cos, sin, HQ, HKV, D, qw, kw, 1e-6, kc, vc, slots, k_scale=0.25, v_scale=0.5)
    kr, vr = torch.zeros_like(kc), torch.zeros_like(vc)
    store_kvcache_ref(k, v, kr, vr, slots, 0.25, 0.5)
    assert torch.equal(_bytes(kc), _bytes(kr)) and torch.equal(_bytes(vc), _bytes(vr))


def _cache_and_tables(lens, num_blocks=256):
    kc = (torch.randn(num_blocks, BS, HKV, D, device="cuda") * 4).to(FP8_DTYPE)
    vc = (torch.randn(num_blocks, BS, HKV, D, device="cuda") * 4).to(FP8_DTYPE)
    perm = torch.randperm(num_blocks).tolist()
    width = max(-(-n // BS) for n in lens) + 1
    bt = torch.full((len(lens), width), -1, dtype=torch.int32)
    pos = 0
    for b, n in enumerate(lens):
        need = -(-n // BS)
        bt[b, :need] = torch.tensor(perm[pos:pos + need])
        pos += need
    return kc, vc, bt.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_decode_over_fp8_cache(num_splits):
    lens = [1, 300, 1024, 77, 2000]
    kc, vc, bt, cl = _cache_and_tables(lens)
    q = torch.randn(len(lens), HKV * G, D, device="cuda", dtype=torch.bfloat16)
    out = paged_attention.paged_attention_decode(q, kc, vc, bt, cl, D ** -0.5, num_splits=num_splits,
                                                 k_scale=0.3, v_scale=0.7)
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, D ** -0.5, 0.3, 0.7)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_prefill_over_fp8_cache():
    lens, q_lens = [40, 700, 129], [40, 200, 1]
    kc, vc, bt, cl = _cache_and_tables(lens)
    cu = torch.tensor([0, 40, 240, 241], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), HKV * G, D, device="cuda", dtype=torch.bfloat16)
    out = paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, 200, D ** -0.5, k_scale=0.3,
                                                          v_scale=0.7)
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, 200, D ** -0.5, 0.3, 0.7)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(1, 4096), (256, 12288), (1000, 4096), (3, 300)])
def test_quantize_rows_matches_reference(shape):
    ranges = torch.logspace(-3, 3, shape[0], device="cuda")[:, None]      # rows of very different sizes
    x = (torch.randn(*shape, device="cuda") * ranges).to(torch.bfloat16)
    x[0, :7] = 0
    q, s = quantize_rows(x)
    s_ref = per_row_scales(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    differ = (q.view(torch.uint8) != quantize_fp8(x, s_ref).view(torch.uint8)).float().mean().item()
    assert differ < 1e-3                     # a division's last bit may move a value across a rounding tie


@pytest.mark.parametrize("rows", [1, 7, 64, 256, 1000])
def test_fp8_linear_scaled_mm_matches_dequantized(rows):
    lin = torch.nn.Linear(4096, 6144, bias=True, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8Linear.from_linear(lin)
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        out = fp8(x)
        ref = fp8_linear_ref(x, fp8.weight, fp8.weight_scale) + lin.bias
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_block_scaled_mm_on_hopper():
    """The shapes of Qwen3-8B's projections take the block-scaled GEMM on an H100/H200."""
    assert blockwise_mm_supported(torch.device("cuda"), 6144, 4096)
    assert not blockwise_mm_supported(torch.device("cuda"), 960, 576)        # SmolLM2's qkv: the reference


@pytest.mark.parametrize("shape", [(5, 4096), (300, 12288)])
def test_group_quantization_matches_reference(shape):
    x = (torch.randn(*shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")).to(torch.bfloat16)
    q, s = _quantize_groups_cuda(x)
    q_ref, s_ref = quantize_act_groups(x)
    assert s.stride() == (1, shape[0])                                 # outer-dim-major, as _scaled_mm takes it
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item() < 1e-3


@pytest.mark.parametrize("tile_rows", [128, 1])
@pytest.mark.parametrize("rows", [1, 7, 64, 256, 1000])
@pytest.mark.parametrize("shape", [(4096, 6144), (12288, 4096), (576, 960)])
def test_fp8_block_linear_matches_reference(rows, shape, tile_rows):
    """128x128 weight tiles (the 1x128 x 128x128 GEMM) and 1x128 ones (1x128 x 1x128); SmolLM2's
    qkv shape takes the reference on every device."""
    k, n = shape
    lin = torch.nn.Linear(k, n, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():                                              # tiles of different ranges
        lin.weight.mul_(torch.logspace(-2, 1, k, device="cuda", dtype=torch.bfloat16))
    fp8 = Fp8BlockLinear.from_linear(lin, tile_rows=tile_rows)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) * torch.logspace(1, -1, k, device="cuda")
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        out = fp8(x)
        ref = fp8_block_linear_ref(x, fp8.weight, fp8.weight_scale) + lin.bias
    assert fp8._fused == blockwise_mm_supported(x.device, n, k)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_engine_fp8_graphs_equal_eager(model):
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 130, 17)]
    outs = []
    for eager in (True, False):
        llm = LLM(model, device="cuda", dtype="float32", kv_cache_dtype="fp8", quantization="fp8",
                  num_kv_blocks=128, enforce_eager=eager, max_num_seqs=8)
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        outs.append([r.token_ids for r in res])
        assert llm.engine.block_manager.is_whole()
        assert llm.engine.model_runner.kv_cache.dtype == FP8_DTYPE
    assert outs[0] == outs[1]
