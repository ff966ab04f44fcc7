"""``pdserve generate``: stream an answer, from the router or (``--offline``) in-process.

The text goes to stdout as it streams; at the end, how the request ended (finish reason and
token usage) goes to stderr, unless ``--quiet``.
"""
from __future__ import annotations

import argparse
import sys

from pdserve.common import env
from pdserve.router.settings import DEFAULT_PORT as ROUTER_PORT


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (rendered with the chat template unless --raw)")
    p.add_argument("--offline", action="store_true", help="run the engine in this process, no services")
    p.add_argument("--router", default=env.get("ROUTER", f"localhost:{ROUTER_PORT}"),
                   help="router address (env PDSERVE_ROUTER)")
    p.add_argument("--model", default=env.get("MODEL", "default"), help="offline: checkpoint dir or preset")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this probability mass, (0, 1]")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 = all")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (reproducible sampling)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds (router mode)")
    p.add_argument("--quiet", action="store_true", help="print only the text: no finish reason and usage on stderr")


def run(args: argparse.Namespace) -> int:
    from pdserve.common.engine import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    if args.offline:
        return _offline(args, params)
    from pdserve.client import build_request, finish_reason_name, stream_responses
    last = None
    for resp in stream_responses(args.router, build_request(args.prompt, params, chat=not args.raw),
                                 timeout=args.timeout):
        if resp.text:
            sys.stdout.write(resp.text)
            sys.stdout.flush()
        if resp.finish_reason:
            last = resp
    sys.stdout.write("\n")
    sys.stdout.flush()
    if last is not None and not args.quiet:
        sys.stderr.write(summary(finish_reason_name(last.finish_reason), last.usage.prompt_tokens,
                                 last.usage.completion_tokens, last.usage.cached_tokens, last.matched_stop) + "\n")
    return 0


def summary(reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
            matched_stop: str = "") -> str:
    """``[finish_reason=length prompt_tokens=.. completion_tokens=.. cached_tokens=..]``."""
    stop = f" matched_stop={matched_stop!r}" if matched_stop else ""
    return (f"[finish_reason={reason}{stop} prompt_tokens={prompt_tokens} completion_tokens={completion_tokens} "
            f"cached_tokens={cached_tokens}]")


def _offline(args: argparse.Namespace, params) -> int:
    from pdserve.common.engine import LLM
    llm = LLM(args.model)
    prompt = (args.prompt if args.raw
              else llm.apply_chat_template([{"role": "user", "content": args.prompt}]))
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
