"""Command-line flags of the engine's scheduling that every front end shares (workers, the
offline CLI, benchmarks), named as vLLM names them, with PDSERVE_* environment defaults."""
from __future__ import annotations

import argparse

from pdserve.common import env
from pdserve.common.config import KV_CACHE_DTYPES, EngineConfig


def add_chunked_prefill_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for chunked prefill and the TPOT guard's (also used by the offline CLI and
    benchmarks); defaults: EngineConfig's."""
    d = EngineConfig()
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=env.get_bool("ENABLE_CHUNKED_PREFILL", d.enable_chunked_prefill),
                   help="mix decode rows and prompt chunks in one step under --max-num-batched-tokens "
                        "(env PDSERVE_ENABLE_CHUNKED_PREFILL; default on)")
    p.add_argument("--max-num-partial-prefills", type=int,
                   default=env.get_int("MAX_NUM_PARTIAL_PREFILLS", d.max_num_partial_prefills),
                   help="prompts that may be partly prefilled at once (chunked prefill)")
    p.add_argument("--long-prefill-token-threshold", type=int,
                   default=env.get_int("LONG_PREFILL_TOKEN_THRESHOLD", d.long_prefill_token_threshold),
                   help="cap on one prompt's chunk per step, so later prompts share the budget; 0 = no cap")
    p.add_argument("--max-mixed-batched-tokens", type=int,
                   default=env.get_int("MAX_MIXED_BATCHED_TOKENS", d.max_mixed_batched_tokens),
                   help="token budget of a step with decode rows (rows + prompt chunks); a step without "
                        "decode rows keeps --max-num-batched-tokens, so a worker that is not decoding "
                        "prefills in prefill-sized steps. 0 = --max-num-batched-tokens")
    p.add_argument("--tpot-target-ms", type=float, default=env.get_float("TPOT_TARGET_MS", d.tpot_target_ms),
                   help="TPOT guard: a step with decode rows carries only the prompt tokens that keep its "
                        "predicted time under this target (the engine's own step-time model); without decode "
                        "rows a step takes the whole budget. 0 = off, except for requests that set their own "
                        "target (env PDSERVE_TPOT_TARGET_MS)")
    p.add_argument("--tpot-margin", type=float, default=env.get_float("TPOT_MARGIN", d.tpot_margin),
                   help="share of the TPOT target the guard keeps free for the model's error")


def chunked_prefill_kwargs(args: argparse.Namespace) -> dict:
    return {"enable_chunked_prefill": args.enable_chunked_prefill,
            "max_num_partial_prefills": args.max_num_partial_prefills,
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
            "max_mixed_batched_tokens": args.max_mixed_batched_tokens,
            "tpot_target_ms": args.tpot_target_ms, "tpot_margin": args.tpot_margin}


def add_fp8_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's ``--kv-cache-dtype`` and ``--quantization`` (docs/design.md, "FP8"); defaults:
    EngineConfig's."""
    d = EngineConfig()
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=env.get("KV_CACHE_DTYPE", d.kv_cache_dtype),
                   help="KV cache element type: auto (the model's dtype) or fp8 (e4m3 with per-tensor scales: "
                        "twice the blocks in the same memory); every worker of a deployment must agree "
                        "(env PDSERVE_KV_CACHE_DTYPE)")
    p.add_argument("--quantization", choices=("fp8",), default=env.get("QUANTIZATION", d.quantization),
                   help="fp8: FP8 weights (an FP8 checkpoint in its own scales, or a bf16 one quantized at "
                        "load with a scale per output channel and 128-wide block) and dynamic activation "
                        "scales; default: none (env PDSERVE_QUANTIZATION)")


def fp8_kwargs(args: argparse.Namespace) -> dict:
    return {"kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
