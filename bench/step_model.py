"""Lab: a step-level time model of W-nano, to say what per-step cost a throughput target needs.

The engine runs W-nano as FCFS chunked prefill under a token budget (decode rows first, then
prompt chunks) followed by decode steps. The model charges every step

    F + (KV tokens read) * kv_bytes / BW + (weights / BW     if the step has no prompt tokens
                                           prompt_tokens * c  otherwise: compute-bound)

with ``F`` the fixed cost of a step over its bytes floor (kernel boundaries, GEMMs and small
kernels short of the bandwidth, LM head and sampler) and ``c`` the measured cost per prompt
token. Both are fitted from a step trace (``bench/step_trace.py``): ``F`` is the decode steps'
mean of busy time minus bytes floor, ``c`` the prefill steps' busy time less ``F`` per token, so
the model's GPU time equals the trace's by construction; the run's wall time adds the trace's
GPU idle time (start-up, gaps), kept as is. The model then says how the wall time moves with
``F``: the ``F`` a target needs, and the throughput if ``F`` were only ``--kernels`` kernel
boundaries of ``--boundary-us`` each (``bench/boundary_probe.py``).

    python -m bench.step_model --trace bench/results/step_trace_h100.json --target 22000 \\
        --out bench/results/boundary_probe/step_model_h100_trace.json
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from bench.common import write_result
from bench.workloads import w_nano
from pdserve.common.loader import resolve_model
from pdserve.common.models.decoder import DecoderForCausalLM


@dataclass(frozen=True)
class StepCosts:
    fixed_s: float               # F: per step, over the bytes floor
    prefill_token_s: float       # c: per prompt token of a step with prompt tokens
    bandwidth: float             # bytes/s
    weight_bytes: int
    kv_bytes_per_token: int


def simulate(prompts: list[int], outputs: list[int], costs: StepCosts, budget: int) -> tuple[float, int]:
    """(seconds, steps) of FCFS chunked prefill under ``budget`` tokens a step, then decode."""
    n, nxt, done, gen = len(prompts), 0, [0] * len(prompts), [0] * len(prompts)
    running: list[int] = []
    seconds, steps = 0.0, 0
    while running or nxt < n:
        room, prompt_tokens, admitted = budget - len(running), 0, []
        while nxt < n and room > 0:
            take = min(prompts[nxt] - done[nxt], room)
            done[nxt] += take
            room -= take
            prompt_tokens += take
            if done[nxt] < prompts[nxt]:
                break
            admitted.append(nxt)
            nxt += 1
        kv = sum(prompts[i] + gen[i] for i in running) * costs.kv_bytes_per_token / costs.bandwidth
        body = prompt_tokens * costs.prefill_token_s if prompt_tokens else costs.weight_bytes / costs.bandwidth
        seconds += costs.fixed_s + kv + body
        steps += 1
        for i in running + admitted:          # a completed prompt samples its first token
            gen[i] += 1
        running = [i for i in running + admitted if gen[i] < outputs[i]]
    return seconds, steps


def model_bytes(model: str) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of ``model`` in bf16, built on the meta device."""
    cfg = resolve_model(model).config
    with torch.device("meta"):
        net = DecoderForCausalLM(cfg)
    weights = sum(p.numel() for p in net.parameters()) * 2
    return weights, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2


def fit(trace: dict, weight_bytes: int, kv_bytes_per_token: int) -> StepCosts:
    """F and c from a step trace's per-batch-size buckets."""
    decode = [v for k, v in trace["by_batch"].items() if k.startswith("decode")]
    steps = sum(v["steps"] for v in decode)
    fixed = sum(v["busy_s"] - v["floor_s"] for v in decode) / steps
    pre = trace["by_batch"]["prefill"]
    per_token = (pre["busy_s"] - pre["steps"] * fixed) / pre["tokens"]
    return StepCosts(fixed, per_token, trace["copy_bandwidth_GBps"] * 1e9, weight_bytes, kv_bytes_per_token)


def required_fixed(tok_s: Callable[[float], float], fitted: float, target: float) -> float | None:
    """The largest F whose throughput meets ``target`` (bisection over [0, fitted]); None when
    even F = 0 falls short, ``fitted`` when it already meets it."""
    if tok_s(0.0) < target:
        return None
    if tok_s(fitted) >= target:
        return fitted
    lo, hi = 0.0, fitted
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tok_s(mid) >= target else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="bench/results/step_trace_h100.json")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--budget", type=int, default=16384, help="max_num_batched_tokens")
    p.add_argument("--target", type=float, default=22000.0, help="output tok/s (wall time)")
    p.add_argument("--kernels", type=int, default=258,
                   help="kernels of a decode step: 253 in the graph (28 layers x 9 + final norm), "
                        "embedding, LM head and sampler outside")
    p.add_argument("--boundary-us", type=float, default=1.27, help="one kernel boundary in a graph")
    p.add_argument("--out", default="bench/results/step_model.json")
    args = p.parse_args(argv)
    weights, kv_bytes = model_bytes(args.model)
    with open(args.trace) as f:
        trace = json.load(f)
    costs = fit(trace, weights, kv_bytes)
    idle_s = trace["wall_s"] - trace["total"]["busy_s"]       # GPU idle in the traced run
    w = w_nano()
    prompts, outputs = [len(x) for x in w.prompts], [sp.max_tokens for sp in w.params]
    tokens = sum(outputs)

    def tok_s(fixed: float) -> float:
        seconds, _ = simulate(prompts, outputs, replace(costs, fixed_s=fixed), args.budget)
        return tokens / (seconds + idle_s)

    seconds, steps = simulate(prompts, outputs, costs, args.budget)
    needed = required_fixed(tok_s, costs.fixed_s, args.target)
    boundaries = args.kernels * args.boundary_us * 1e-6
    result = {"fit": vars(costs), "idle_s": idle_s, "model_busy_s": seconds, "model_steps": steps,
              "model_tok_s": tokens / (seconds + idle_s), "trace_wall_s": trace["wall_s"],
              "trace_tok_s": trace.get("output_tok_s"), "target_tok_s": args.target,
              "fixed_s_for_target": needed, "boundaries_only_fixed_s": boundaries,
              "boundaries_only_tok_s": tok_s(boundaries), "config": vars(args)}
    print(f"fit: F = {1e3 * costs.fixed_s:.3f} ms/step, c = {1e6 * costs.prefill_token_s:.2f} us/prompt token, "
          f"GPU idle {idle_s:.3f} s; model {seconds + idle_s:.3f} s ({steps} steps, "
          f"{result['model_tok_s']:,.0f} tok/s) vs trace {trace['wall_s']:.3f} s; {args.target:,.0f} tok/s needs "
          + (f"F <= {1e3 * needed:.3f} ms" if needed is not None else "more than F = 0 gives")
          + f"; F = {args.kernels} boundaries x {args.boundary_us} us = {1e3 * boundaries:.3f} ms -> "
          f"{result['boundaries_only_tok_s']:,.0f} tok/s")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
