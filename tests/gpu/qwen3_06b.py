"""The Qwen3-0.6B geometry in bf16 on CUDA twice with the same random weights: HF transformers'
model (the oracle) and ours on the Triton backend, for the GPU logit tests."""
from __future__ import annotations

import json

import torch

from pdserve.common.config import ModelConfig
from pdserve.common.loader import PRESET_DIR
from pdserve.common.models.decoder import DecoderForCausalLM


def hf_and_ours(seed: int = 0) -> tuple[torch.nn.Module, DecoderForCausalLM]:
    import transformers as tf
    cfg_dict = json.loads((PRESET_DIR / "qwen3-0.6b.json").read_text())
    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = tf.AutoModelForCausalLM.from_config(tf.AutoConfig.for_model(**cfg_dict), dtype=torch.bfloat16,
                                                 attn_implementation="sdpa").eval()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            ours = DecoderForCausalLM(ModelConfig.from_hf_dict(cfg_dict, "qwen3-0.6b"), "triton")
    finally:
        torch.set_default_dtype(torch.float32)
    ours.load_weights(hf.state_dict().items())
    return hf, ours
