"""Tiny random HF transformers models saved as checkpoint dirs: the numerics oracle."""
from __future__ import annotations

from pathlib import Path

import torch

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=1024, initializer_range=0.25,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)


def make_tiny_checkpoint(kind: str, path: Path, seed: int = 0):
    """Save a tiny random ``kind`` ("qwen3", "qwen2", "llama") model to ``path``; return the HF model."""
    import transformers as tf
    torch.manual_seed(seed)
    if kind == "qwen3":
        cfg = tf.Qwen3Config(**TINY, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**TINY, num_key_value_heads=2, tie_word_embeddings=False)
    elif kind == "llama":
        cfg = tf.LlamaConfig(**TINY, num_key_value_heads=1, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    model_cls = {"qwen3": tf.Qwen3ForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "llama": tf.LlamaForCausalLM}[kind]
    model = model_cls(cfg).eval()
    if kind == "qwen2":  # random biases so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by HF transformers, ignoring EOS."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


TIE_TOLERANCE = 1e-4     # float32 logits closer than this are a tie: either token is greedy


@torch.no_grad()
def assert_greedy_matches(model, prompts: list[list[int]], got: list[list[int]],
                          expected: list[list[int]], tol: float = TIE_TOLERANCE) -> None:
    """``got`` equals HF's greedy ``expected`` token for token, except after a tie.

    A sequence that differs is checked teacher-forced: each of its tokens must be within ``tol``
    of the highest HF logit given the prompt and the tokens before it. Random tiny models do
    produce near-ties (seen: 4.777902 vs 4.777898), and a batch's summation order may break them
    either way; any other difference fails with the position and both logits.
    """
    assert len(got) == len(expected) == len(prompts)
    for i, (prompt, ours, theirs) in enumerate(zip(prompts, got, expected)):
        if ours == theirs:
            continue
        assert len(ours) == len(theirs), f"prompt {i}: {len(ours)} tokens, HF {len(theirs)}"
        ids = list(prompt)
        for pos, token in enumerate(ours):
            logits = model(torch.tensor([ids])).logits[0, -1]
            best = int(logits.argmax())
            assert logits[token] >= logits[best] - tol, (
                f"prompt {i}, token {pos}: got {token} (logit {logits[token]:.6f}), "
                f"HF greedy {best} (logit {logits[best]:.6f})")
            ids.append(token)
