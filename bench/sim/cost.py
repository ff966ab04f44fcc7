"""How long a simulated worker's GPU takes: pure functions of token counts (modelled, not measured).

Prefill of a batch of prompts (one engine step on the prefill worker)::

    prefill_ms = scale * (prefill_base_ms + prefill_ms_per_token * new_tokens)

``new_tokens``: the batch's prompt tokens not found in the worker's prefix cache (a cache hit
saves exactly its tokens' compute). A prefill worker runs one batch at a time, FIFO, up to
``max_batched_tokens`` new tokens per batch (a prompt larger than that runs alone).

Decode step on a decode worker (one token for each running request)::

    decode_ms = scale * (decode_base_ms + decode_ms_per_seq * batch + decode_ms_per_kilotoken * context_tokens / 1000)

``context_tokens``: the KV the step reads (every running request's prompt + generated tokens).

Defaults: an 8B-parameter model (Qwen3-8B geometry, bf16) on one H100-class GPU, rounded:
~12k prompt tokens/s of prefill, a ~8 ms decode step at small batch (16 GB of weights read),
147 KB of KV per token read at ~3 TB/s (0.05 ms per 1,000 tokens of context). ``scale``
stretches every time (the simulation runs ``scale`` times slower than the modelled GPUs so that
a 2-core machine keeps up; request rates are divided by the same factor).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    scale: float = 1.0
    prefill_base_ms: float = 5.0
    prefill_ms_per_token: float = 0.08
    decode_base_ms: float = 8.0
    decode_ms_per_seq: float = 0.02
    decode_ms_per_kilotoken: float = 0.05
    max_batched_tokens: int = 8192

    def prefill_ms(self, new_tokens: int) -> float:
        return self.scale * (self.prefill_base_ms + self.prefill_ms_per_token * new_tokens)

    def decode_ms(self, batch: int, context_tokens: int) -> float:
        return self.scale * (self.decode_base_ms + self.decode_ms_per_seq * batch
                             + self.decode_ms_per_kilotoken * context_tokens / 1000.0)


def take_batch(queued_new_tokens: list[int], max_batched_tokens: int) -> int:
    """How many queued prompts (FIFO, by their new-token counts) the next prefill batch takes:
    as many as fit in ``max_batched_tokens``, and at least one."""
    total = n = 0
    for t in queued_new_tokens:
        if n and total + t > max_batched_tokens:
            break
        total += t
        n += 1
    return n
