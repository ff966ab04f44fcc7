"""Guided JSON decoding against unguided decoding: output tok/s of the offline engine at one batch.

    python -m bench.guided_gpu --out bench/results/guided_h100.json       # H100: Qwen3-0.6B, batch 64

Issue 42's bar: guided JSON at most 10% below unguided output tok/s (nvidia-h100-x1, batch 64);
the exit status is 1 when the ratio is below ``--min-ratio`` (0.9).

Both runs send the same ``--batch`` prompts of ``--prompt-len`` random ids, at temperature
``--temperature``, each exactly ``--max-tokens`` output tokens: unguided with ``ignore_eos``,
guided under a JSON Schema that cannot be complete before ``--max-tokens`` (an array of at least
``MIN_ITEMS`` objects), so every row decodes every step in both runs and only the guide differs:
the host fills each step's bitmask (xgrammar) while the forward runs, and the sampler masks the
logits on the device. Output tok/s = output tokens / wall time of one ``generate`` after a
warm-up run of the same kind; ``--rounds`` alternate unguided and guided, the best of each kept.

The default model is the Qwen3-0.6B preset with dummy weights; a preset has no tokenizer, so the
grammar is compiled against the embedded model's tokenizer padded to the preset's vocabulary
(151,936 tokens: every bitmask row and masked logit row has the real width). With random weights
the guided rows pick whatever the grammar allows, which is what costs: the mask, not the text.
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import time

from bench.common import write_result
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.guided.state import GuideCompiler
from pdserve.common.sampling_params import Guide

logger = logging.getLogger(__name__)
MIN_ITEMS = 10_000
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["events"], "properties": {
    "events": {"type": "array", "minItems": MIN_ITEMS, "items": {
        "type": "object", "additionalProperties": False, "required": ["id", "level", "message"],
        "properties": {"id": {"type": "integer"}, "level": {"enum": ["debug", "info", "warn", "error"]},
                       "message": {"type": "string"}}}}}}


def build(args: argparse.Namespace) -> LLM:
    llm = LLM(args.model, max_num_seqs=max(args.batch, 1), max_model_len=args.prompt_len + args.max_tokens + 16)
    eng = llm.engine
    if eng.tokenizer is None:      # a preset: the embedded model's tokenizer at the preset's width
        from transformers import AutoTokenizer

        from pdserve.common.default_model import ensure_default_model
        tok = AutoTokenizer.from_pretrained(args.tokenizer or str(ensure_default_model()))
        eng.guides = GuideCompiler(tok, eng.source.config.vocab_size, [tok.eos_token_id])
    return llm


def workload(args: argparse.Namespace, guided: bool) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    top = min(10_000, args.vocab_size - 1)      # ids inside any vocabulary
    prompts = [[rng.randint(0, top) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    guide = Guide("json_schema", json.dumps(SCHEMA)) if guided else None
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=args.max_tokens, guide=guide)
              for _ in range(args.batch)]
    return prompts, params


def run_once(llm: LLM, args: argparse.Namespace, guided: bool) -> float:
    """Output tok/s of one generate (every row must make exactly max_tokens tokens)."""
    prompts, params = workload(args, guided)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    took = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    if tokens != args.batch * args.max_tokens:
        raise RuntimeError(f"{'guided' if guided else 'unguided'}: {tokens} tokens, expected "
                           f"{args.batch * args.max_tokens} (a row ended early)")
    return tokens / took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b", help="preset name, checkpoint dir, or 'default'")
    p.add_argument("--tokenizer", default="",
                   help="a tokenizer directory for a preset (default: the embedded model's)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-ratio", type=float, default=0.9)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    llm = build(args)
    args.vocab_size = llm.engine.source.config.vocab_size
    run_once(llm, args, False)      # warm-up: kernels, the grammar's compile, the allocator
    run_once(llm, args, True)
    unguided, guided = [], []
    for _ in range(args.rounds):
        unguided.append(run_once(llm, args, False))
        guided.append(run_once(llm, args, True))
    ratio = max(guided) / max(unguided)
    result = {"model": args.model, "batch": args.batch, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
              "temperature": args.temperature, "unguided_tok_s": unguided, "guided_tok_s": guided,
              "ratio_best": ratio, "min_ratio": args.min_ratio, "pass": ratio >= args.min_ratio}
    print(f"unguided {max(unguided):,.0f} tok/s, guided JSON {max(guided):,.0f} tok/s: ratio {ratio:.3f} "
          f"({'pass' if ratio >= args.min_ratio else 'FAIL'}, bar {args.min_ratio})")
    if args.out:
        write_result(args.out, result)
    return 0 if ratio >= args.min_ratio else 1


if __name__ == "__main__":
    raise SystemExit(main())
