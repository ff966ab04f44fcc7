"""FP8 weights (``--quantization fp8``): Fp8Linear (per channel) and Fp8BlockLinear (128x128 weight
tiles, 1x128 activation groups) against the dequantized torch product on fresh random inputs, the
swap of a model's projections, and FP8 checkpoints in the hub's two formats (block-scaled
``weight_scale_inv`` as Qwen3-8B-FP8 ships, per-channel compressed-tensors) read back from a tiny
HF checkpoint: the dequantized weights exactly, a 128x128 checkpoint served with ``--quantization
fp8`` as its own e4m3 values and scales, and the per-channel checkpoint served identical to
quantizing the bf16 checkpoint per channel at load."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.common.engine import LLM
from pdserve.common.engine.perplexity import negative_log_likelihood
from pdserve.common.layers.fp8_block_linear import Fp8BlockLinear, quantize_act_groups, quantize_weight_blocks
from pdserve.common.layers.fp8_linear import Fp8Linear, fp8_linear_ref, quantize_weight
from pdserve.common.models.quantize import PROJECTIONS
from pdserve.common.models.quantize import quantize_fp8 as quantize_model
from pdserve.common.ops.fp8 import FP8_DTYPE, per_row_scales, quantize_fp8
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


@pytest.mark.parametrize("tile_rows", [128, 1])
def test_fp8_block_linear_is_the_block_scaled_product(tile_rows):
    gen = torch.Generator().manual_seed(2)
    lin = torch.nn.Linear(300, 200, bias=True)                        # ragged last blocks along K and N
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 300, generator=gen) * torch.logspace(-2, 0, 300))
        lin.bias.copy_(torch.randn(200, generator=gen))
    fp8 = Fp8BlockLinear.from_linear(lin, tile_rows=tile_rows)
    assert fp8.weight.dtype == FP8_DTYPE and fp8.weight_scale.shape == ({128: 2, 1: 200}[tile_rows], 3)
    x = torch.randn(4, 6, 300, generator=gen)
    xq, xs = quantize_act_groups(x.reshape(-1, 300))
    assert xs.shape == (24, 3)
    expand = torch.ones(tile_rows, 128)                              # tile scales over their tiles, by hand
    w = fp8.weight.float() * torch.kron(fp8.weight_scale, expand)[:200, :300]
    xd = xq.float() * torch.kron(xs, torch.ones(1, 128))[:, :300]
    ref = (xd @ w.t()).reshape(4, 6, 200) + lin.bias
    torch.testing.assert_close(fp8(x), ref, rtol=1e-5, atol=1e-5)
    exact = lin(x).detach()
    assert float((fp8(x) - exact).norm() / exact.norm()) < 0.05
    with pytest.raises(ValueError, match="weight_scale"):
        Fp8BlockLinear(fp8.weight, torch.ones(200, 1), tile_rows=tile_rows)
    with pytest.raises(ValueError, match="tile_rows"):
        Fp8BlockLinear(fp8.weight, fp8.weight_scale, tile_rows=64)


def test_quantize_weight_blocks_scales_each_tile():
    ranges = torch.logspace(-3, 1, 6).reshape(2, 3)                 # tiles of very different ranges
    w = torch.randn(256, 384) * torch.kron(ranges, torch.ones(128, 128))
    q, s = quantize_weight_blocks(w)
    assert s.shape == (2, 3)
    tiles = q.float().reshape(2, 128, 3, 128).abs().amax(dim=(1, 3))
    assert tiles.eq(448).all()                                       # each tile's max maps to e4m3's max
    full = torch.kron(s, torch.ones(128, 128))
    err = (q.float() * full - w).abs()
    assert (err <= w.abs() / 16 + full * 2 ** -10).all()              # half an e4m3 step (or subnormal step)


def test_token_groups_keep_a_row_beside_an_outlier():
    """A token whose row has one outlier channel: per-token scaling sends the rest of the row to
    e4m3's subnormals and zero, per-group scaling keeps it in the other groups."""
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(3))
    x[0, 5] = 3e5
    per_token = quantize_fp8(x, per_row_scales(x)).float() * per_row_scales(x)
    q, s = quantize_act_groups(x)
    per_group = q.float() * s.repeat_interleave(128, 1)
    rest = slice(128, 512)
    err_token = float((per_token[0, rest] - x[0, rest]).norm() / x[0, rest].norm())
    err_group = float((per_group[0, rest] - x[0, rest]).norm() / x[0, rest].norm())
    assert err_token > 0.3 and err_group < 0.05, (err_token, err_group)


def _block_quantize(t: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in ``b`` x ``b`` blocks (a ragged last block on its own values), scale = amax / 448."""
    n, k = t.shape
    nb, kb = -(-n // b), -(-k // b)
    padded = torch.nn.functional.pad(t.float(), (0, kb * b - k, 0, nb * b - n))
    scale = padded.reshape(nb, b, kb, b).abs().amax(dim=(1, 3)) / 448
    full = scale.repeat_interleave(b, 0)[:n].repeat_interleave(b, 1)[:, :k]
    return (t / full).clamp(-448, 448).to(FP8_DTYPE), scale


def _fp8_checkpoint(src, dst, fmt: str) -> None:
    """``src`` (a bf16/fp32 HF checkpoint) with its projections in FP8, as ``fmt`` publishes them:
    "block" (32x32 blocks), "block128" (128x128, as Qwen3-8B-FP8) or "channel"."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    block = {"block": 32, "block128": 128}.get(fmt)
    for name, t in tensors.items():
        if not name.endswith("_proj.weight"):
            out[name] = t
            continue
        if block:
            out[name], out[name + "_scale_inv"] = _block_quantize(t, block)
        else:
            out[name], out[name + "_scale"] = quantize_weight(t)
    out["model.layers.1.self_attn.k_scale"] = torch.tensor(0.5)
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = (
        {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
        if block else
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}})
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    make_tiny_checkpoint("qwen3", root / "bf16", seed=5)
    _fp8_checkpoint(root / "bf16", root / "block", "block")
    _fp8_checkpoint(root / "bf16", root / "block128", "block128")
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


def test_block_checkpoint_serves_its_own_blocks(checkpoints):
    """A 128x128 checkpoint under ``--quantization fp8``: Fp8BlockLinear holding the published e4m3
    bytes and scales wherever the model's tiles are the checkpoint's (the merged qkv tiles k and v
    together here: their 64 rows each share a tile)."""
    layers = _runner(checkpoints / "block128", quantization="fp8").model.layers
    t = load_file(str(checkpoints / "block128" / "model.safetensors"))
    for i in range(2):
        for mod, names in ((layers[i].mlp.down_proj, ["mlp.down_proj"]), (layers[i].self_attn.o_proj,
                           ["self_attn.o_proj"]), (layers[i].mlp.gate_up_proj, ["mlp.gate_proj", "mlp.up_proj"])):
            assert isinstance(mod, Fp8BlockLinear) and mod.tile_rows == 128
            q = torch.cat([t[f"model.layers.{i}.{n}.weight"] for n in names])
            s = torch.cat([t[f"model.layers.{i}.{n}.weight_scale_inv"] for n in names])
            assert torch.equal(mod.weight.view(torch.uint8), q.view(torch.uint8))
            torch.testing.assert_close(mod.weight_scale, s, rtol=1e-6, atol=0)


def test_bf16_checkpoint_quantizes_per_channel_by_default_and_to_1x128_blocks_on_request(checkpoints):
    runner = _runner(checkpoints / "bf16", quantization="fp8")
    mods = [getattr(getattr(layer, o), a) for layer in runner.model.layers for o, a in PROJECTIONS]
    assert all(isinstance(m, Fp8Linear) for m in mods)             # the scheme measured on the GPU
    model = _runner(checkpoints / "bf16").model
    quantize_model(model, "block1x128")
    mods = [getattr(getattr(layer, o), a) for layer in model.layers for o, a in PROJECTIONS]
    assert all(isinstance(m, Fp8BlockLinear) and m.tile_rows == 1 for m in mods)
    assert mods[0].weight_scale.shape == (mods[0].out_features, 1)  # K = 64: one ragged block
    with pytest.raises(ValueError, match="scheme"):
        quantize_model(_runner(checkpoints / "bf16").model, "tensor")


def test_channel_checkpoint_serves_as_quantized_at_load(checkpoints):
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    per_channel = _runner(checkpoints / "bf16")
    quantize_model(per_channel.model, "channel")
    at_load = negative_log_likelihood(per_channel, ids, 40)
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
