"""FP8 weights (``--quantization fp8``): Fp8Linear against the dequantized torch product on fresh
random inputs, the swap of a model's projections, and FP8 checkpoints in the hub's two formats
(block-scaled ``weight_scale_inv`` as Qwen3-8B-FP8 ships, per-channel compressed-tensors) read
back from a tiny HF checkpoint: the dequantized weights exactly, and the per-channel checkpoint
served with ``--quantization fp8`` identical to quantizing the bf16 checkpoint at load."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.engine import LLM
from pdserve.common.engine.perplexity import negative_log_likelihood
from pdserve.common.layers.fp8_linear import Fp8Linear, fp8_linear_ref, quantize_weight
from pdserve.common.ops.fp8 import FP8_DTYPE, quantize_fp8
from tests.unit.hf_models import make_tiny_checkpoint


def test_fp8_linear_is_the_dequantized_product():
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen) * 0.05)
        lin.bias.copy_(torch.randn(48, generator=gen))
    fp8 = Fp8Linear.from_linear(lin)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale.shape == (48, 1)
    x = torch.randn(3, 5, 64, generator=gen)
    y = fp8(x)
    ref = fp8_linear_ref(x.reshape(-1, 64), fp8.weight, fp8.weight_scale).reshape(3, 5, 48) + lin.bias
    torch.testing.assert_close(y, ref)
    exact = lin(x).detach()
    assert float((y - exact).norm() / exact.norm()) < 0.05          # e4m3 keeps ~2 significant digits
    with pytest.raises(ValueError, match="weight_scale"):
        Fp8Linear(fp8.weight, torch.ones(48))


def test_quantize_weight_per_channel():
    w = torch.randn(16, 32) * torch.logspace(-3, 1, 16)[:, None]      # rows of very different ranges
    q, s = quantize_weight(w)
    assert q.float().abs().amax(dim=1).eq(448).all()                 # each row's max maps to e4m3's max
    torch.testing.assert_close(q.float() * s, w, rtol=0.07, atol=0)


def _fp8_checkpoint(src, dst, fmt: str) -> None:
    """``src`` (a bf16/fp32 HF checkpoint) with its projections in FP8, as ``fmt`` publishes them."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            out[name] = t
            continue
        if fmt == "block":                                            # 32x32 blocks, scale = amax / 448
            n, k = t.shape
            blocks = t.reshape(n // 32, 32, k // 32, 32)
            scale = blocks.abs().amax(dim=(1, 3)) / 448
            q = (blocks / scale[:, None, :, None]).clamp(-448, 448).to(FP8_DTYPE).reshape(n, k)
            out[name], out[name + "_scale_inv"] = q, scale
        else:
            out[name], out[name + "_scale"] = quantize_weight(t)
    out["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
        if fmt == "block" else
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}})
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    make_tiny_checkpoint("qwen3", root / "bf16", seed=5)
    _fp8_checkpoint(root / "bf16", root / "block", "block")
    _fp8_checkpoint(root / "bf16", root / "channel", "channel")
    return root


def _runner(path, **kw):
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=16, **kw).engine.model_runner


def test_block_scaled_checkpoint_reads_back_dequantized(checkpoints):
    runner = _runner(checkpoints / "block")
    t = load_file(str(checkpoints / "block" / "model.safetensors"))
    q, s = t["model.layers.0.mlp.down_proj.weight"], t["model.layers.0.mlp.down_proj.weight_scale_inv"]
    expect = q.float() * s.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(runner.model.layers[0].mlp.down_proj.weight, expect)
    assert runner.model.layers[1].self_attn.attn.k_scale == 0.5       # the checkpoint's KV cache scale
    assert runner.model.layers[0].self_attn.attn.k_scale == 1.0


def test_channel_checkpoint_serves_as_quantized_at_load(checkpoints):
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    at_load = negative_log_likelihood(_runner(checkpoints / "bf16", quantization="fp8"), ids, 40)
    published = _runner(checkpoints / "channel", quantization="fp8")
    assert isinstance(published.model.layers[0].self_attn.qkv_proj, Fp8Linear)
    assert negative_log_likelihood(published, ids, 40) == at_load
    exact = negative_log_likelihood(_runner(checkpoints / "bf16"), ids, 40)
    assert abs(at_load[0] - exact[0]) / exact[0] < 0.05


def test_unknown_quantization_is_refused(checkpoints, tmp_path):
    shutil.copytree(checkpoints / "bf16", tmp_path / "awq")
    cfg = json.loads((tmp_path / "awq" / "config.json").read_text())
    (tmp_path / "awq" / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="awq"):
        _runner(tmp_path / "awq")
    assert quantize_fp8(torch.tensor([1.0])).dtype == FP8_DTYPE
