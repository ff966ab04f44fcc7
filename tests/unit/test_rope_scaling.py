"""Llama 3's rope scaling (``rope_type: llama3``, Llama-3.1 / 3.2 / 3.3 checkpoints): the inverse
frequencies equal transformers' own, the config reads both HF spellings and refuses the other
types by name, and greedy output equals HF's on a tiny random Llama whose prompts run past its
``original_max_position_embeddings`` (where the scaling changes the logits)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from pdserve.common.config import ModelConfig, RopeScaling
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.engine.ranks import source_from_json, source_to_json
from pdserve.common.layers.rotary import RotaryEmbedding, default_inv_freq, llama3_inv_freq
from pdserve.common.loader import ModelSource
from tests.unit.hf_models import TINY, assert_greedy_matches, hf_greedy

ORIGINAL_MAX = 32          # the tiny model's pretraining length: prompts below run past it
MAX_NEW = 24


def _llama3_block(factor: float, original: int = 8192) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}


def _hf_inv_freq(head_dim: int, theta: float, block: dict) -> torch.Tensor:
    import transformers as tf
    from transformers.modeling_rope_utils import _compute_llama3_parameters
    cfg = tf.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=131072, rope_theta=theta, rope_scaling=dict(block))
    inv_freq, attention_factor = _compute_llama3_parameters(cfg)
    assert attention_factor == 1.0          # llama3 does not rescale cos / sin
    return inv_freq


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("factor", [8.0, 32.0])
@pytest.mark.parametrize("theta", [500000.0, 10000.0])
def test_inv_freq_equals_transformers(head_dim, factor, theta):
    block = _llama3_block(factor)
    expected = _hf_inv_freq(head_dim, theta, block)
    scaling = ModelConfig.from_hf_dict(_hf_dict(block, head_dim=head_dim, theta=theta)).rope_scaling
    assert scaling == RopeScaling(factor, 1.0, 4.0, 8192)
    base = default_inv_freq(head_dim, theta)
    got = llama3_inv_freq(base, scaling)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # all three bands are present: kept, divided by factor, and interpolated
    assert (got == base).any() and torch.isclose(got, base / factor, rtol=1e-6, atol=0).any()
    assert ((got < base) & (got > base / factor * (1 + 1e-5))).any()


def test_cos_sin_cache_uses_the_scaled_frequencies():
    scaling = RopeScaling(8.0, 1.0, 4.0, 64)
    rot, plain = RotaryEmbedding(32, 256, 10000.0, scaling), RotaryEmbedding(32, 256, 10000.0)
    inv_freq = llama3_inv_freq(default_inv_freq(32, 10000.0), scaling)
    freqs = torch.outer(torch.arange(256, dtype=torch.float32), inv_freq)
    torch.testing.assert_close(rot.cos_cache, torch.cat((freqs, freqs), -1).cos())
    torch.testing.assert_close(rot.sin_cache, torch.cat((freqs, freqs), -1).sin())
    assert not torch.allclose(rot.cos_cache, plain.cos_cache)


def _hf_dict(block: dict | None, key: str = "rope_scaling", head_dim: int = 128, theta: float = 500000.0) -> dict:
    d = {"model_type": "llama", "vocab_size": 128, "hidden_size": head_dim * 4, "intermediate_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": head_dim,
         "max_position_embeddings": 131072, "rope_theta": theta}
    if block is not None:
        d[key] = block
    return d


@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])    # transformers 4.x / 5.x
def test_config_reads_both_spellings(key):
    block = dict(_llama3_block(32.0), rope_theta=500000.0)
    cfg = ModelConfig.from_hf_dict(_hf_dict(block, key))
    assert cfg.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)
    assert cfg.rope_theta == 500000.0


def test_config_default_rope_has_no_scaling():
    assert ModelConfig.from_hf_dict(_hf_dict(None)).rope_scaling is None
    assert ModelConfig.from_hf_dict(_hf_dict({"rope_type": "default", "rope_theta": 1e4}, "rope_parameters")
                                    ).rope_scaling is None


def test_original_length_falls_back_as_transformers_does():
    block = {k: v for k, v in _llama3_block(8.0).items() if k != "original_max_position_embeddings"}
    assert ModelConfig.from_hf_dict(_hf_dict(block)).rope_scaling.original_max_position_embeddings == 131072
    top = dict(_hf_dict(_llama3_block(8.0)), original_max_position_embeddings=4096)
    assert ModelConfig.from_hf_dict(top).rope_scaling.original_max_position_embeddings == 4096


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear", "longrope"])
@pytest.mark.parametrize("type_key", ["rope_type", "type"])
def test_other_rope_types_are_refused_by_name(rope_type, type_key):
    with pytest.raises(ValueError, match=f"rope_scaling: type '{rope_type}' is not supported"):
        ModelConfig.from_hf_dict(_hf_dict({type_key: rope_type, "factor": 4.0}))


def test_incomplete_or_invalid_llama3_block_is_refused():
    with pytest.raises(ValueError, match="needs low_freq_factor"):
        ModelConfig.from_hf_dict(_hf_dict({"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}))
    with pytest.raises(ValueError, match="low_freq_factor < high_freq_factor"):
        ModelConfig.from_hf_dict(_hf_dict(dict(_llama3_block(8.0), high_freq_factor=1.0)))
    with pytest.raises(ValueError, match="factor must be > 0"):
        ModelConfig.from_hf_dict(_hf_dict(_llama3_block(0.0)))


def test_scaling_survives_the_rank_spec_round_trip():
    """Tensor-parallel ranks rebuild the config from JSON (engine/ranks.py)."""
    cfg = ModelConfig.from_hf_dict(_hf_dict(_llama3_block(8.0)))
    back = source_from_json(json.loads(json.dumps(source_to_json(ModelSource(cfg, None, None)))))
    assert back.config.rope_scaling == cfg.rope_scaling
    assert back.config == cfg


def _make_checkpoint(path, seed: int = 0):
    """A tiny random Llama with llama3 rope scaling saved to ``path``; return the HF model."""
    import transformers as tf
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=False,
                         rope_scaling=_llama3_block(8.0, ORIGINAL_MAX))
    model = tf.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3-rope")
    model = _make_checkpoint(path)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 57, 90)]
    expected = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return path, prompts, expected, model


@torch.no_grad()
def test_scaling_changes_the_tiny_models_logits(checkpoint):
    """The parity test below is meaningful: past ORIGINAL_MAX the unscaled rope gives other logits."""
    import transformers as tf
    _, prompts, _, model = checkpoint
    plain = tf.LlamaForCausalLM(tf.LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=False)).eval()
    plain.load_state_dict(model.state_dict())
    ids = torch.tensor([prompts[-1]])
    assert not torch.allclose(model(ids).logits[0, -1], plain(ids).logits[0, -1], atol=1e-3)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_matches_hf_past_the_original_length(checkpoint, overlap):
    path, prompts, expected, model = checkpoint
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=16, num_kv_blocks=64,
              async_scheduling=overlap)
    assert llm.engine.source.config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, ORIGINAL_MAX)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                        use_tqdm=False)
    assert_greedy_matches(model, prompts, [o.token_ids for o in outs], expected)
    assert llm.engine.block_manager.is_whole()
