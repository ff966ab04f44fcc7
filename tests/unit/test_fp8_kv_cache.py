"""The FP8 (e4m3) KV cache: the torch store/read references against a dequantized oracle, the
Triton store and attention kernels (Triton's interpreter on a CPU machine, compiled on a GPU)
against those references on fresh random inputs, and the engine's pool in FP8 (dtype, twice
the blocks of a bf16 pool in the same memory, generation end to end on the torch backend).

The interpreter's float->fp8 conversion does not carry a rounding into the exponent, so the
kernel store is checked here on values an e4m3 number holds exactly (and on saturation); the
GPU test (tests/gpu/test_fp8_gpu.py) checks the rounding of arbitrary values.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from pdserve.common.config import EngineConfig, resolve_kv_cache_dtype  # noqa: E402
from pdserve.common.ops.fp8 import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8  # noqa: E402
from pdserve.common.ops.reference import (  # noqa: E402
    paged_attention_decode_ref,
    paged_attention_prefill_ref,
    store_kvcache_ref,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS, HKV, G, D = 8, 2, 2, 16


def _fp8_cache(num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """A random e4m3 cache ``[num_blocks, BS, HKV, D]`` (values of a few units, some tiny)."""
    x = torch.randn(num_blocks, BS, HKV, D, generator=gen) * 3
    return x.to(FP8_DTYPE).to(DEVICE)


def _exact_inputs(n: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    """``[n, HKV, D]`` values that divided by ``scale`` (a power of two) are e4m3 numbers."""
    return (torch.randn(n, HKV, D, generator=gen) * 8).to(FP8_DTYPE).float() * scale


def _block_tables(lens: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    need = [-(-n // BS) for n in lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    bt = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    pos = 0
    for b, k in enumerate(need):
        bt[b, :k] = torch.tensor(perm[pos:pos + k], dtype=torch.int32)
        pos += k
    return bt.to(DEVICE)


def test_quantize_saturates_and_round_trips():
    x = torch.tensor([0.0, 1.0, -2.5, 1000.0, -1e6, 3.0])
    q = quantize_fp8(x, 0.5)
    assert q.dtype == FP8_DTYPE
    assert dequantize_fp8(q, 0.5).tolist() == [0.0, 1.0, -2.5, FP8_MAX * 0.5, -FP8_MAX * 0.5, 3.0]
    assert not torch.isnan(dequantize_fp8(q)).any()


def test_kv_cache_dtype_names():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


def test_reference_store_then_read_is_the_dequantized_attention():
    """The FP8 references equal the fp32 references run on the dequantized cache."""
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(20, HKV, D, generator=gen) * 4, torch.randn(20, HKV, D, generator=gen)
    kc = torch.zeros(6, BS, HKV, D, dtype=FP8_DTYPE)
    vc = torch.zeros_like(kc)
    slots = torch.arange(20, dtype=torch.int32)
    slots[3] = -1
    store_kvcache_ref(k, v, kc, vc, slots, k_scale=0.5, v_scale=0.125)
    assert torch.equal(kc.view(-1, HKV, D)[5].view(torch.uint8), quantize_fp8(k[5], 0.5).view(torch.uint8))
    assert kc.view(-1, HKV, D)[3].float().abs().sum() == 0            # a padding slot is skipped
    kd, vd = dequantize_fp8(kc, 0.5), dequantize_fp8(vc, 0.125)
    q = torch.randn(2, HKV * G, D, generator=gen)
    bt = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32)
    lens = torch.tensor([20, 11], dtype=torch.int32)
    torch.testing.assert_close(paged_attention_decode_ref(q, kc, vc, bt, lens, 0.25, 0.5, 0.125),
                               paged_attention_decode_ref(q, kd, vd, bt, lens, 0.25))
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    q3 = torch.randn(3, HKV * G, D, generator=gen)
    torch.testing.assert_close(paged_attention_prefill_ref(q3, kc, vc, cu, lens, bt, 2, 0.25, 0.5, 0.125),
                               paged_attention_prefill_ref(q3, kd, vd, cu, lens, bt, 2, 0.25))


triton = pytest.importorskip("triton")
from pdserve.common.ops import kv_store, paged_attention, paged_attention_prefill  # noqa: E402


@pytest.mark.parametrize("seed", [0, 1])
def test_triton_store_matches_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    n, ks, vs = 13, 0.25, 2.0
    k, v = _exact_inputs(n, ks, gen), _exact_inputs(n, vs, gen)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 500 * ks, -449 * ks])     # saturated at +-448 * scale
    slots = torch.randperm(5 * BS, generator=gen)[:n].to(torch.int32)
    slots[2] = -1
    k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
    caches = [torch.zeros(5, BS, HKV, D, dtype=FP8_DTYPE, device=DEVICE) for _ in range(4)]
    kv_store.store_kvcache(k, v, caches[0], caches[1], slots, k_scale=ks, v_scale=vs)
    store_kvcache_ref(k, v, caches[2], caches[3], slots, ks, vs)
    assert torch.equal(caches[0].view(torch.uint8), caches[2].view(torch.uint8))
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    assert caches[0].float().abs().max() == FP8_MAX


@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_reads_fp8(num_splits):
    gen = torch.Generator().manual_seed(10 + num_splits)
    kc, vc = _fp8_cache(16, gen), _fp8_cache(16, gen)
    lens = [37, 1, 20]
    bt = _block_tables(lens, 16, gen)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(3, HKV * G, D, generator=gen).to(DEVICE)
    out = paged_attention.paged_attention_decode(q, kc, vc, bt, cl, 0.25, num_splits=num_splits, k_scale=0.5,
                                                 v_scale=0.25)
    ref = paged_attention_decode_ref(q, kc, vc, bt, cl, 0.25, 0.5, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_triton_prefill_reads_fp8():
    gen = torch.Generator().manual_seed(3)
    kc, vc = _fp8_cache(16, gen), _fp8_cache(16, gen)
    lens, q_lens = [37, 9], [5, 9]
    bt = _block_tables(lens, 16, gen)
    cl = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 5, 14], dtype=torch.int32, device=DEVICE)
    q = torch.randn(sum(q_lens), HKV * G, D, generator=gen).to(DEVICE)
    out = paged_attention_prefill.paged_attention_prefill(q, kc, vc, cu, cl, bt, 9, 0.25, k_scale=2.0, v_scale=0.5)
    ref = paged_attention_prefill_ref(q, kc, vc, cu, cl, bt, 9, 0.25, 2.0, 0.5)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_engine_pool_in_fp8_holds_twice_the_blocks():
    from pdserve.common.engine import LLM, SamplingParams
    pools = {}
    for kv in ("auto", "fp8"):
        llm = LLM("tiny-qwen3", dtype="bfloat16", device="cpu", kv_cache_memory_gb=0.002, kv_cache_dtype=kv,
                  max_model_len=256, max_num_batched_tokens=256)
        runner = llm.engine.model_runner
        out = llm.generate([[5, 6, 7, 8, 9] * 7], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
        assert len(out[0].token_ids) == 6
        pools[kv] = (runner.kv_cache.dtype, runner.num_kv_blocks)
    assert pools["auto"][0] == torch.bfloat16 and pools["fp8"][0] == torch.float8_e4m3fn
    assert pools["fp8"][1] == 2 * pools["auto"][1]
