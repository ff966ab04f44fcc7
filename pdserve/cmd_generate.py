"""``pdserve generate``: stream an answer, from the router or (``--offline``) in-process."""
from __future__ import annotations

import argparse
import sys

from common import env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the user message (rendered with the chat template unless --raw)")
    p.add_argument("--offline", action="store_true", help="run the engine in this process, no services")
    p.add_argument("--router", default=env.get("ROUTER", "localhost:50051"), help="router address (env PDSERVE_ROUTER)")
    p.add_argument("--model", default=env.get("MODEL", "default"), help="offline: checkpoint dir or preset")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, no chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds (router mode)")


def run(args: argparse.Namespace) -> int:
    from common.engine import SamplingParams
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    if args.offline:
        return _offline(args, params)
    from pdserve.client import stream_generate
    for delta in stream_generate(args.router, args.prompt, params, chat=not args.raw, timeout=args.timeout):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _offline(args: argparse.Namespace, params) -> int:
    from common.engine import LLM
    llm = LLM(args.model)
    prompt = (args.prompt if args.raw
              else llm.apply_chat_template([{"role": "user", "content": args.prompt}]))
    for delta in llm.stream(prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
