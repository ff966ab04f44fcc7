"""Find a model by name or path and build it: an HF checkpoint dir (real weights), ``"default"``
(the embedded model, default_model.py), or a preset name / ``config.json`` path (seeded dummy
weights).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pdserve.common.config import ModelConfig
from pdserve.common.models import fp8_checkpoint
from pdserve.common.models.decoder import DecoderForCausalLM
from pdserve.common.models.quantize import DEFAULT_WEIGHT_SCHEME, quantize_fp8, set_kv_scales
from pdserve.common.parallel import RankGroup

logger = logging.getLogger(__name__)
PRESET_DIR = Path(__file__).parent / "presets"
DEFAULT_ALIASES = ("default", "SmolLM2-135M-Instruct", "smollm2-135m-instruct")


@dataclass(frozen=True)
class ModelSource:
    config: ModelConfig
    checkpoint_dir: Path | None    # None: dummy weights
    tokenizer_dir: Path | None     # None: no tokenizer (token ids only)


def available_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.json"))


def resolve_model(model: str) -> ModelSource:
    """Where ``model`` comes from; raises FileNotFoundError naming the problem otherwise."""
    if model in DEFAULT_ALIASES:
        from pdserve.common.default_model import ensure_default_model
        path = ensure_default_model()
        return ModelSource(ModelConfig.from_file(path / "config.json"), path, path)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model: {path} has no config.json")
        if not list(path.glob("*.safetensors")):
            raise FileNotFoundError(f"model: {path} has no *.safetensors weights")
        tokenizer = path if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() else None
        return ModelSource(ModelConfig.from_file(path / "config.json"), path, tokenizer)
    if path.suffix == ".json" and path.is_file():
        return ModelSource(ModelConfig.from_file(path, path.stem), None, None)
    preset = PRESET_DIR / f"{model}.json"
    if preset.is_file():
        return ModelSource(ModelConfig.from_file(preset, model), None, None)
    raise FileNotFoundError(
        f"model: {model!r} is neither a checkpoint directory nor a preset "
        f"(presets: {', '.join(available_presets())}; or 'default' for the embedded model)")


def _safetensors_weights(ckpt_dir: Path):
    for file in sorted(ckpt_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _init_dummy(model: DecoderForCausalLM, seed: int) -> None:
    """Seeded normal weights (norms 1, biases 0). Each rank draws every full tensor in the same
    order and keeps its slice, so a model split over N ranks has the one-rank model's weights."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif model.full_shape(name) == tuple(param.shape):
                param.normal_(0.0, 0.02, generator=gen)
            else:
                full = torch.empty(model.full_shape(name), dtype=param.dtype, device=param.device)
                model.load_param(name, full.normal_(0.0, 0.02, generator=gen))
                del full


def build_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
                attention_backend: str, seed: int = 0, group: RankGroup | None = None,
                quantization: str | None = None) -> DecoderForCausalLM:
    """The model on ``device`` in ``dtype`` with checkpoint or seeded dummy weights; with a rank
    ``group`` of N ranks, this rank's shard of it. An FP8 checkpoint is read dequantized
    (models/fp8_checkpoint.py); ``quantization`` "fp8" then makes the projections FP8
    (models/quantize.py)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DecoderForCausalLM(source.config, attention_backend, group)
    finally:
        torch.set_default_dtype(previous)
    quant_cfg = None
    if source.checkpoint_dir is None:
        _init_dummy(model, seed)
        logger.info("model %s: dummy weights (seed %d)", source.config.name, seed)
    else:
        kv_scales: dict[str, float] = {}
        quant_cfg = fp8_checkpoint.read_quant_config(source.checkpoint_dir)
        loaded = model.load_weights(fp8_checkpoint.dequantized(_safetensors_weights(source.checkpoint_dir),
                                                               quant_cfg, dtype, kv_scales))
        missing = model.expected_loads() - loaded
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
        set_kv_scales(model, kv_scales)
        logger.info("model %s: weights from %s%s", source.config.name, source.checkpoint_dir,
                    f" (FP8 checkpoint, {quant_cfg['quant_method']})" if quant_cfg else "")
    if quantization == "fp8":
        scheme = fp8_checkpoint.weight_scheme(quant_cfg) or DEFAULT_WEIGHT_SCHEME
        quantize_fp8(model, scheme)
        if device.type == "cuda":
            torch.cuda.empty_cache()        # the bf16 weights' memory back to the KV pool's sizing
        logger.info("model %s: projections in FP8 (%s weight scales)", source.config.name, scheme)
    model.eval()
    return model
