"""A prompt of the model's full context served by chunked prefill while other sequences keep
decoding (one GPU): ``--num-decoding`` requests decode; then one ``--prompt-len`` prompt arrives
and is prefilled in chunks of at most ``--budget`` tokens per step, each step also carrying
every running decode row.

    python -m bench.long_prompt --model qwen3-0.6b --prompt-len 32768 --budget 8192 \
        --out bench/results/long_prompt.json

Reports the long prompt's time to first token, the steps it spanned, whether every one of those
steps also decoded all the other sequences, their step times (the other sequences' inter-token
latency meanwhile), and the long prompt's greedy tokens against an unchunked engine's (whole
prompt in one step) on the same weights.
"""
from __future__ import annotations

import argparse
import logging
import random
import time

import torch

from bench.common import write_result
from pdserve.common.engine import LLM, SamplingParams
from pdserve.common.loader import resolve_model

logger = logging.getLogger(__name__)


def _serve(llm: LLM, args, prompt: list[int], others: list[list[int]]) -> dict:
    eng = llm.engine
    decode_params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, p in enumerate(others):
        eng.add_request(p, decode_params, request_id=f"d{i}")
    while sum(s.num_completion_tokens > 0 for s in eng.scheduler.running) < len(others):
        eng.step()
    eng.step()                    # with overlapped steps: the last prefill's output comes one call late
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    long = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                           request_id="long")
    steps, first_token_s = [], None
    while not long.is_finished:
        t0 = time.perf_counter()
        out = eng.step()
        steps.append({"ms": (time.perf_counter() - t0) * 1e3, "decode_rows": out.num_decode_rows,
                      "prefill_tokens": out.num_prefill_tokens, "long_prefilling": first_token_s is None})
        if first_token_s is None and long.num_completion_tokens > 0 and long.completion_token_ids[0] >= 0:
            first_token_s = time.perf_counter() - start
    for i in range(len(others)):
        eng.abort(f"d{i}")
    while eng.has_unfinished():
        eng.step()
    during = [s for s in steps if s["long_prefilling"] and s["prefill_tokens"]]
    # with overlapped steps a step's output (its rows) is reported by the next call
    ms = sorted(s["ms"] for s in during)
    return {"ttft_s": first_token_s, "prefill_steps": len(during),
            "others_decoded_every_step": all(s["decode_rows"] >= len(others) for s in during),
            "step_ms_during_prefill": {"max": ms[-1], "median": ms[len(ms) // 2]} if ms else None,
            "max_prefill_tokens_per_step": max((s["prefill_tokens"] for s in steps), default=0),
            "tokens": long.completion_token_ids, "pool_whole": eng.block_manager.is_whole(), "steps": steps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--num-decoding", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--no-reference", action="store_true", help="skip the unchunked reference run")
    p.add_argument("--out", default="bench/results/long_prompt.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    rng = random.Random(0)
    vocab = min(10000, resolve_model(args.model).config.vocab_size)
    prompt = [rng.randrange(vocab) for _ in range(args.prompt_len)]
    others = [[rng.randrange(vocab) for _ in range(rng.randint(20, min(800, args.prompt_len)))]
              for _ in range(args.num_decoding)]
    max_len = args.prompt_len + args.max_tokens + 16
    llm = LLM(args.model, max_model_len=max_len, max_num_batched_tokens=args.budget, max_num_seqs=64)
    chunked = _serve(llm, args, prompt, others)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    result = {"config": vars(args), "chunked": chunked}
    if not args.no_reference:
        ref = LLM(args.model, max_model_len=max_len, max_num_batched_tokens=max_len, max_num_seqs=64,
                  enable_chunked_prefill=False)
        out = ref.generate([prompt], SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
                           use_tqdm=False)[0]
        same = sum(a == b for a, b in zip(out.token_ids, chunked["tokens"]))
        result["unchunked_tokens"] = out.token_ids
        result["tokens_equal_to_unchunked"] = f"{same}/{len(out.token_ids)}"
    write_result(args.out, result)
    c = chunked
    print(f"prompt {args.prompt_len} tokens, budget {args.budget}: TTFT {c['ttft_s']:.3f} s over {c['prefill_steps']} "
          f"steps, others decoded every step: {c['others_decoded_every_step']}, step ms during prefill "
          f"{c['step_ms_during_prefill']}, pool whole: {c['pool_whole']}, "
          f"vs unchunked: {result.get('tokens_equal_to_unchunked')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
