"""Perplexity of a token sequence under an engine's model, through the engine's own forward: the
paged KV pool in its cache dtype, the attention backend, the weights as loaded (FP8 or not).

The ids are cut into consecutive windows of ``window`` tokens; each window is prefilled as one
sequence from position 0 into blocks ``0..`` of the pool (overwritten by the next window), and
every token after a window's first is scored by the logprob the model gave it. The pool must be
allocated and hold a window; the engine must have nothing in flight (its blocks are reused).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from pdserve.common.context import ForwardContext, forward_context

if TYPE_CHECKING:
    from pdserve.common.engine.model_runner import ModelRunner

__all__ = ["negative_log_likelihood", "perplexity"]


def _window_context(n: int, block_size: int, device: torch.device) -> ForwardContext:
    """One prefilled sequence of ``n`` tokens in blocks ``0..ceil(n / block_size) - 1``."""
    def i32(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)
    blocks = -(-n // block_size)
    return ForwardContext(is_prefill=True, slot_mapping=i32(list(range(n))), context_lens=i32([n]),
                          block_tables=i32([list(range(blocks))]), cu_seqlens_q=i32([0, n]), max_seqlen_q=n)


@torch.inference_mode()
def negative_log_likelihood(runner: ModelRunner, token_ids: list[int], window: int) -> tuple[float, int]:
    """(summed negative logprob in nats, number of scored tokens) of ``token_ids``."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    if -(-window // runner.block_size) > runner.num_kv_blocks:
        raise ValueError(f"a window of {window} tokens needs more than the pool's {runner.num_kv_blocks} blocks")
    total, count = 0.0, 0
    for start in range(0, len(token_ids), window):
        ids = token_ids[start:start + window]
        if len(ids) < 2:
            break
        n = len(ids)
        input_ids = torch.tensor(ids, dtype=torch.int64, device=runner.device)
        positions = torch.arange(n, dtype=torch.int64, device=runner.device)
        with forward_context(_window_context(n, runner.block_size, runner.device)):
            hidden = runner.model(input_ids, positions)
        logprobs = torch.log_softmax(runner.model.compute_logits(hidden[:-1]).float(), dim=-1)
        total -= float(logprobs.gather(1, input_ids[1:, None]).sum())
        count += n - 1
    return total, count


def perplexity(runner: ModelRunner, token_ids: list[int], window: int) -> float:
    """``exp`` of the mean negative logprob of every scored token (see the module docstring)."""
    total, count = negative_log_likelihood(runner, token_ids, window)
    if count == 0:
        raise ValueError("no token to score: give at least two ids")
    return math.exp(total / count)
