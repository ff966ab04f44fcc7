"""The geometry presets (pdserve/common/presets, dummy weights): each resolves by name to the
published model's shape; the two added for the engine's shapes (issue: head_dim 64 with MHA, and
GQA 3:1 with a tied 128k vocabulary) are checked field by field."""
from __future__ import annotations

import pytest

from pdserve.common.loader import available_presets, resolve_model

# name: layers, hidden, q heads, kv heads, head_dim, intermediate, vocab, tied
GEOMETRY = {
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936, True),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936, False),
    "qwen2.5-7b": (28, 3584, 28, 4, 128, 18944, 152064, False),
    "smollm2-1.7b": (24, 2048, 32, 32, 64, 8192, 49152, True),
    "llama3.2-3b": (28, 3072, 24, 8, 128, 8192, 128256, True),
    "qwen3-32b": (64, 5120, 64, 8, 128, 25600, 151936, False),
    "llama3.1-70b": (80, 8192, 64, 8, 128, 28672, 128256, False),
}


@pytest.mark.parametrize("name", sorted(GEOMETRY))
def test_preset_geometry(name):
    c = resolve_model(name).config
    got = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
           c.intermediate_size, c.vocab_size, c.tie_word_embeddings)
    assert got == GEOMETRY[name]
    assert name in available_presets()
