"""The offline workloads of docs/design.md, generated exactly as defined there."""
from __future__ import annotations

import random
from dataclasses import dataclass

from pdserve.common.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)


def _nano_prompts(num_seqs: int = 256) -> list[list[int]]:
    """Seeds the global random module (as the workload defines) and draws the prompts."""
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(num_seqs)]
    return prompts


def w_nano(num_seqs: int = 256) -> Workload:
    """256 prompts of 100..1024 random ids, max_tokens 100..1024, temperature 0.6, ignore_eos."""
    prompts = _nano_prompts(num_seqs)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(100, 1024))
              for _ in range(num_seqs)]
    return Workload("W-nano", prompts, params)


def w_uniform(num_seqs: int = 256, max_tokens: int = 512) -> Workload:
    """The same prompts, exactly 512 output tokens each, greedy, EOS disabled."""
    prompts = _nano_prompts(num_seqs)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens) for _ in range(num_seqs)]
    return Workload("W-uniform", prompts, params)


def decode_bytes(workload: Workload, kv_bytes_per_token: int, weight_bytes: int) -> int:
    """Bytes a decode must read at least: the weights once per step, every context's KV once per token.

    Steps = the longest output (all sequences run concurrently); token ``t`` of a request with
    prompt ``p`` reads ``p + t`` tokens of KV.
    """
    kv_tokens = 0
    for prompt, params in zip(workload.prompts, workload.params):
        p, o = len(prompt), params.max_tokens
        kv_tokens += o * p + o * (o - 1) // 2
    steps = max(p.max_tokens for p in workload.params)
    return kv_tokens * kv_bytes_per_token + steps * weight_bytes


def prefill_flops(workload: Workload, linear_params: int, num_layers: int, num_heads: int, head_dim: int) -> int:
    """FLOPs the prompts' prefill must compute at least: every prompt token through every
    linear layer (2 FLOPs per weight), causal attention (QK^T and PV: 4 * heads * head_dim per
    (query, key) pair with key <= query) in every layer. The lm_head runs on one row per prompt
    and is left out (under 0.1% here)."""
    tokens = workload.num_prompt_tokens
    pairs = sum(len(p) * (len(p) + 1) // 2 for p in workload.prompts)
    return 2 * linear_params * tokens + 4 * num_layers * num_heads * head_dim * pairs
