"""FP8 quality on real weights: the embedded SmolLM2-135M's perplexity on a public-domain text
(tests/data/kjv_genesis.txt, 22,215 tokens) through the engine's own forward (CPU, torch
backend), against the same engine with float32 weights, activations and cache (REFERENCE_DTYPE):
within 1% with the FP8 KV cache, within 3% with FP8 weights (the issue's bounds; FP8 weights, in
the default scheme of models/quantize.py, miss theirs on this model, so that test is a strict
xfail until they meet it).

The default suite scores the FP8 cache on the first SUBSET_TOKENS tokens (one window); the whole
text takes about 800 s a pass on two shared cores, so it runs with PDSERVE_FULL_PERPLEXITY=1
(``make test-perplexity``), FP8 weights included. Measured figures: bench/notes/fp8.md.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdserve.common.default_model import ensure_default_model
from pdserve.common.engine import LLM
from pdserve.common.engine.perplexity import perplexity

TEXT = Path(__file__).resolve().parents[1] / "data" / "kjv_genesis.txt"
REFERENCE_DTYPE = "float32"
SUBSET_TOKENS = 512
FULL_WINDOW = 1024
FULL = os.environ.get("PDSERVE_FULL_PERPLEXITY") == "1"
KV_BOUND, WEIGHTS_BOUND = 0.01, 0.03
WEIGHTS_GAP = ("W8A8 FP8 costs this 135M model (itself from a 4-bit GGUF) more than 3% perplexity over float32 "
               "on the whole text: +3.27% with 1x128 weight blocks and activation groups, +4.6% with the "
               "default (per channel and per token); e4m3 weights alone about +2.8% (bench/notes/fp8.md)")


@pytest.fixture(scope="module")
def token_ids() -> list[int]:
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(ensure_default_model())(TEXT.read_text())["input_ids"]
    assert len(ids) >= 20_000
    return ids if FULL else ids[:SUBSET_TOKENS]


def _perplexity(token_ids: list[int], **flags) -> float:
    window = FULL_WINDOW if FULL else SUBSET_TOKENS
    llm = LLM("default", device="cpu", dtype=REFERENCE_DTYPE, num_kv_blocks=window // 16 + 1, warmup=False, **flags)
    return perplexity(llm.engine.model_runner, token_ids, window)


@pytest.fixture(scope="module")
def reference(token_ids) -> float:
    return _perplexity(token_ids)


def test_fp8_kv_cache_within_one_percent(token_ids, reference):
    ppl = _perplexity(token_ids, kv_cache_dtype="fp8")
    assert ppl >= reference * 0.99 and ppl <= reference * (1 + KV_BOUND), (ppl, reference)


@pytest.mark.skipif(not FULL, reason="a known miss (below): scored on the whole text only")
@pytest.mark.xfail(strict=True, reason=WEIGHTS_GAP)
def test_fp8_weights_within_three_percent(token_ids, reference):
    ppl = _perplexity(token_ids, quantization="fp8")
    assert ppl <= reference * (1 + WEIGHTS_BOUND), (ppl, reference)
