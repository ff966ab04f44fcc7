"""The small-batch decode chain: its kernels against torch, its forward against the model's usual
forward, and where it applies. CPU: the Triton interpreter (kernels in fp32, the forward in
fp16); on a CUDA machine the same checks run compiled, in bf16, with PDL on Hopper."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from pdserve.common.config import ModelConfig  # noqa: E402
from pdserve.common.context import ForwardContext, forward_context  # noqa: E402
from pdserve.common.loader import PRESET_DIR  # noqa: E402
from pdserve.common.models import dataflow_decode  # noqa: E402
from pdserve.common.models.decoder import DecoderForCausalLM  # noqa: E402
from pdserve.common.ops import dataflow  # noqa: E402
from pdserve.common.ops.gemm_tiles import WIDE_ROWS  # noqa: E402
from pdserve.common.ops.pdl import pdl_available  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
KERNEL_DTYPE = torch.bfloat16 if CUDA else torch.float32
MODEL_DTYPE = torch.bfloat16 if CUDA else torch.float16
SMALL = {"model_type": "qwen3", "hidden_size": 512, "intermediate_size": 1024, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "vocab_size": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 256, "tie_word_embeddings": True}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _tol() -> float:
    return 1e-2 if CUDA else 1e-5


@pytest.mark.parametrize("m", [1, 5, 16, 17, 32])
def test_splitk_partials_sum_to_the_product(m):
    torch.manual_seed(m)
    a = torch.randn(m, 1024, device=DEVICE, dtype=KERNEL_DTYPE)
    w = torch.randn(64, 1024, device=DEVICE, dtype=KERNEL_DTYPE) / 32
    part = dataflow.splitk(a, w)
    assert part.shape == (2, m, 64) and part.dtype == torch.float32
    assert _rel(part.sum(0), a.float() @ w.float().t()) < _tol()


@pytest.mark.parametrize("k", [512, 1024])
def test_preload_linear_matches_linear(k):
    torch.manual_seed(k)
    a = torch.randn(3, k, device=DEVICE, dtype=KERNEL_DTYPE)
    w = torch.randn(96, k, device=DEVICE, dtype=KERNEL_DTYPE) / k ** 0.5
    out = dataflow.preload_linear(a, w)
    assert out.dtype == a.dtype and _rel(out, a.float() @ w.float().t()) < _tol()


def test_preload_linear_refuses_more_than_preload_rows():
    a = torch.randn(dataflow.PRELOAD_ROWS + 1, 512, device=DEVICE, dtype=KERNEL_DTYPE)
    with pytest.raises(AssertionError):
        dataflow.preload_linear(a, torch.randn(32, 512, device=DEVICE, dtype=KERNEL_DTYPE))


def test_qkv_preloads_rule():
    assert dataflow_decode.qkv_preloads(1, 1024) and dataflow_decode.qkv_preloads(dataflow.PRELOAD_ROWS, 512)
    assert not dataflow_decode.qkv_preloads(dataflow.PRELOAD_ROWS + 1, 1024)     # 17-32 rows: split over K
    assert not dataflow_decode.qkv_preloads(4, 1536)                             # K of three tiles: split


def test_one_partial_rounds_as_the_fused_kernels_do():
    """With one partial holding the GEMM output, the partial-summing kernels are the fused
    add+RMSNorm and SiLU-mul, bit for bit."""
    from pdserve.common.ops.fused import rms_norm, silu_and_mul
    torch.manual_seed(4)
    x = torch.randn(5, 96, device=DEVICE, dtype=KERNEL_DTYPE)
    res = torch.randn(5, 96, device=DEVICE, dtype=KERNEL_DTYPE)
    w = 1 + 0.1 * torch.randn(96, device=DEVICE, dtype=KERNEL_DTYPE)
    out, res_out = dataflow.add_norm_partials(x.float()[None], res, w, 1e-6)
    ref_out, ref_res = rms_norm(x, w, 1e-6, res)
    assert torch.equal(out, ref_out) and torch.equal(res_out, ref_res)
    gu = torch.randn(5, 160, device=DEVICE, dtype=KERNEL_DTYPE)
    assert torch.equal(dataflow.silu_partials(gu.float()[None], KERNEL_DTYPE), silu_and_mul(gu))


def test_add_norm_partials_and_silu_partials():
    torch.manual_seed(3)
    m, h, inter = 4, 96, 80
    part = torch.randn(3, m, h, device=DEVICE)
    res = torch.randn(m, h, device=DEVICE, dtype=KERNEL_DTYPE)
    w = 1 + 0.1 * torch.randn(h, device=DEVICE, dtype=KERNEL_DTYPE)
    out, res_out = dataflow.add_norm_partials(part, res, w, 1e-6)
    x = part.sum(0).to(KERNEL_DTYPE) + res
    assert _rel(res_out, x) < _tol()
    xf = x.float()
    assert _rel(out, w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))) < _tol()
    gu = torch.randn(2, m, 2 * inter, device=DEVICE)
    act = dataflow.silu_partials(gu, KERNEL_DTYPE)
    s = gu.sum(0)
    assert _rel(act, F.silu(s[:, :inter]) * s[:, inter:]) < _tol()


def test_too_many_rows_is_refused():
    a = torch.randn(dataflow.MAX_ROWS + 1, 512, device=DEVICE, dtype=KERNEL_DTYPE)
    with pytest.raises(AssertionError, match="rows"):
        dataflow.splitk(a, torch.randn(32, 512, device=DEVICE, dtype=KERNEL_DTYPE))


def test_takes_chain_rule():
    assert dataflow_decode.takes_chain(1, False, True, True, True)
    assert dataflow_decode.takes_chain(dataflow.MAX_ROWS, False, True, True, True)
    assert dataflow_decode.takes_chain(dataflow.MAX_ROWS + 1, False, True, True, True)   # the wide range
    assert dataflow_decode.takes_chain(WIDE_ROWS, False, True, True, True)
    assert not dataflow_decode.takes_chain(0, False, True, True, True)                    # empty batch
    assert not dataflow_decode.takes_chain(WIDE_ROWS + 1, False, True, True, True)
    assert not dataflow_decode.takes_chain(4, True, True, True, True)                     # prefill / mixed step
    assert not dataflow_decode.takes_chain(4, False, False, True, True)                   # no PDL
    assert not dataflow_decode.takes_chain(4, False, True, False, True)                   # switched off
    assert not dataflow_decode.takes_chain(4, False, True, True, False)                   # geometry


def test_supports_wide():
    presets = {name: ModelConfig.from_hf_dict(json.loads((PRESET_DIR / f"{name}.json").read_text()))
               for name in ("qwen3-0.6b", "qwen3-8b", "qwen2.5-7b")}
    assert dataflow_decode.supports_wide(presets["qwen3-0.6b"], torch.bfloat16)
    assert not dataflow_decode.supports_wide(presets["qwen3-8b"], torch.bfloat16)         # 34-201 MB weights
    assert not dataflow_decode.supports_wide(presets["qwen2.5-7b"], torch.bfloat16)       # qkv bias
    assert not dataflow_decode.supports_wide(presets["qwen3-0.6b"], torch.float32)        # half precision only
    assert dataflow_decode.supports_wide(ModelConfig.from_hf_dict(SMALL), torch.float16)
    assert not dataflow_decode.supports_wide(ModelConfig.from_hf_dict({**SMALL, "intermediate_size": 1040}),
                                             torch.float16)                              # 1040 / 32 columns


def test_wide_range_needs_hopper_and_a_gluon_it_can_use(monkeypatch):
    assert not dataflow_decode.wide_available(torch.device("cpu"))

    def no_gluon(name: str):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(dataflow_decode.importlib, "import_module", no_gluon)
    assert not dataflow_decode.gluon_importable()             # an older Triton: the usual forward


def test_add_norm_partials_skips_the_padding_rows():
    """Partials of Mp > M rows a split (the Gluon tiles' padding): rows past M are not read."""
    torch.manual_seed(5)
    m, rows, h = 3, 8, 96
    part = torch.randn(2, rows, h, device=DEVICE)
    part[:, m:] = float("nan")
    res = torch.randn(m, h, device=DEVICE, dtype=KERNEL_DTYPE)
    w = 1 + 0.1 * torch.randn(h, device=DEVICE, dtype=KERNEL_DTYPE)
    out, res_out = dataflow.add_norm_partials(part, res, w, 1e-6)
    ref_out, ref_res = dataflow.add_norm_partials(part[:, :m].contiguous(), res, w, 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(res_out, ref_res) and not out.isnan().any()
    padded, res_out = dataflow.add_norm_partials(part, res, w, 1e-6, out_rows=rows)    # whole tiles out
    assert padded.shape == (rows, h) and res_out.shape == (m, h) and torch.equal(padded[:m], ref_out)


def test_supports_the_small_geometries_only():
    qwen3_06b = ModelConfig.from_hf_dict(json.loads((PRESET_DIR / "qwen3-0.6b.json").read_text()))
    qwen3_8b = ModelConfig.from_hf_dict(json.loads((PRESET_DIR / "qwen3-8b.json").read_text()))
    assert dataflow_decode.supports(qwen3_06b, torch.bfloat16, 132)
    assert not dataflow_decode.supports(qwen3_06b, torch.float32, 132)       # half precision only
    assert not dataflow_decode.supports(qwen3_06b, torch.bfloat16, 8)        # gate_up's 384 tiles not resident
    assert not dataflow_decode.supports(qwen3_8b, torch.bfloat16, 132)       # o_proj's 1,024 tiles not resident
    assert dataflow_decode.supports(ModelConfig.from_hf_dict({**SMALL, "hidden_size": 1536}), torch.float16, 132)
    assert dataflow_decode.supports(ModelConfig.from_hf_dict(SMALL), torch.float16, 132)
    for bias in ("attention_bias", "mlp_bias"):                              # e.g. Qwen2's qkv bias
        assert not dataflow_decode.supports(ModelConfig.from_hf_dict({**SMALL, bias: True}), torch.float16, 132)


def _decode_batch(model: DecoderForCausalLM, lens: list[int], block: int = 16):
    """A KV cache of random contents bound to the model, and a decode context for rows of ``lens``."""
    cfg = model.config
    tables = [[b * 4 + j for j in range(-(-n // block))] for b, n in enumerate(lens)]
    width = max(len(t) for t in tables)
    kv = torch.randn(4 * len(lens), cfg.num_hidden_layers, 2, block, cfg.num_key_value_heads, cfg.head_dim,
                     device=DEVICE).to(MODEL_DTYPE)
    slots = [tables[b][(n - 1) // block] * block + (n - 1) % block for b, n in enumerate(lens)]
    ctx = ForwardContext(is_prefill=False, slot_mapping=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                         context_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
                         block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32,
                                                   device=DEVICE), max_context_len=max(lens))
    return kv, ctx


def _bind(model: DecoderForCausalLM, kv: torch.Tensor) -> None:
    for i, layer in enumerate(model.layers):
        layer.self_attn.attn.k_cache, layer.self_attn.attn.v_cache = kv[:, i, 0], kv[:, i, 1]


@pytest.mark.parametrize("lens", [[9], [1, 7, 16, 20, 40], [1 + 2 * i for i in range(dataflow.MAX_ROWS)]])
@pytest.mark.parametrize("hidden", [512, 1536])
def test_forward_matches_the_usual_forward(monkeypatch, lens, hidden):
    """hidden 512: QKV preloaded at <= 16 rows; 1536 (three K tiles) and 32 rows: QKV split over K."""
    torch.manual_seed(len(lens))
    cfg = ModelConfig.from_hf_dict({**SMALL, "hidden_size": hidden})
    model = DecoderForCausalLM(cfg, "triton" if CUDA else "torch").to(DEVICE, MODEL_DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)                              # RMSNorm weights
    kv, ctx = _decode_batch(model, lens)
    ids = torch.randint(0, cfg.vocab_size, (len(lens),), device=DEVICE)
    pos = ctx.context_lens.long() - 1
    kv_ref = kv.clone()
    _bind(model, kv_ref)
    monkeypatch.setenv("PDSERVE_DATAFLOW_DECODE", "0")
    with torch.inference_mode(), forward_context(ctx):
        assert not CUDA or not dataflow_decode.applies(model, ids)
        ref = model(ids, pos)
    monkeypatch.setenv("PDSERVE_DATAFLOW_DECODE", "1")
    _bind(model, kv)
    with torch.inference_mode(), forward_context(ctx):
        if CUDA:            # the model's forward takes it on a GPU with programmatic dependent launch
            assert dataflow_decode.applies(model, ids) == pdl_available(ids.device)
        out = dataflow_decode.forward(model, ids, pos)
    assert out.shape == ref.shape and _rel(out, ref) < 5e-3
    slots = ctx.slot_mapping.long()
    written, written_ref = kv[slots // 16, :, :, slots % 16], kv_ref[slots // 16, :, :, slots % 16]
    assert _rel(written, written_ref) < 1e-2                     # the same K/V stored at the same slots
    assert not written.isnan().any()


@pytest.mark.parametrize("rows", [33, 64, 100, 200, WIDE_ROWS])
def test_wide_forward_matches_the_usual_forward(monkeypatch, rows):
    """The Gluon range (Hopper only): the chain's forward against the usual forward, rows in each
    tile class, hidden 1536 (QKV's K in 12 steps; o_proj's 512 in 4 splits of one step each)."""
    if not CUDA or not dataflow_decode.wide_available(torch.device("cuda")) or not pdl_available(torch.device("cuda")):
        pytest.skip("the Gluon kernels need a Hopper GPU (with PDL)")
    torch.manual_seed(rows)
    cfg = ModelConfig.from_hf_dict({**SMALL, "hidden_size": 1536})
    model = DecoderForCausalLM(cfg, "triton").to(DEVICE, MODEL_DTYPE)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0, 0.1)
    lens = [1 + (7 * i) % 60 for i in range(rows)]
    kv, ctx = _decode_batch(model, lens)
    ids = torch.randint(0, cfg.vocab_size, (rows,), device=DEVICE)
    pos = ctx.context_lens.long() - 1
    kv_ref = kv.clone()
    _bind(model, kv_ref)
    monkeypatch.setenv("PDSERVE_DATAFLOW_WIDE", "0")
    with torch.inference_mode(), forward_context(ctx):
        assert not dataflow_decode.applies(model, ids)
        ref = model(ids, pos)
    monkeypatch.setenv("PDSERVE_DATAFLOW_WIDE", "1")
    _bind(model, kv)
    new_empty = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):          # padding rows start NaN: none may reach a real row
        t = new_empty(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    with torch.inference_mode(), forward_context(ctx):
        assert dataflow_decode.applies(model, ids)
        out = model(ids, pos)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    assert not out.isnan().any()
    assert out.shape == ref.shape and _rel(out, ref) < 5e-3
    slots = ctx.slot_mapping.long()
    written, written_ref = kv[slots // 16, :, :, slots % 16], kv_ref[slots // 16, :, :, slots % 16]
    assert _rel(written, written_ref) < 1e-2 and not written.isnan().any()
