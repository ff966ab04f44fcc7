"""The sampler's fused path alone (temperature-only rows, W-nano's case) at decode batch sizes
with the Qwen3 vocabulary: GPU time per call, and the drawn tokens checked against
``softmax(logits / T)`` on a small vocabulary first.

    python -m bench.sampler --out bench/results/sampler.json
"""
from __future__ import annotations

import argparse

import torch

from bench.common import graph_time, write_result
from pdserve.common.engine.sequence import Sequence
from pdserve.common.layers.sampler import Sampler, prepare_sampling
from pdserve.common.sampling_params import SamplingParams


def batch_for(rows: int, vocab: int, temperature: float):
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=temperature, max_tokens=4), 16) for _ in range(rows)]
    return prepare_sampling(seqs, vocab, torch.device("cuda"), {})


def check_distribution(sampler: Sampler) -> float:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]], device="cuda").repeat(20000, 1)
    draws = sampler(logits, batch_for(20000, 5, 0.7)).token_ids
    freq = torch.bincount(draws.cpu(), minlength=5).double() / 20000
    err = (freq - torch.softmax(logits[0].cpu().double() / 0.7, -1)).abs().max().item()
    assert err < 0.015, (freq, err)
    return err


def time_call(sampler: Sampler, rows: int, vocab: int) -> dict:
    """Microseconds per call: eager (host launch included) and replayed from a CUDA graph (the
    GPU's own time; the graph keeps the seed it was captured with)."""
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16) * 3
    batch = batch_for(rows, vocab, 0.6)
    graph_us = 1e6 * graph_time(lambda: sampler(logits, batch), calls=10, replays=20)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        sampler(logits, batch)
    end.record()
    end.synchronize()
    return {"eager_us": start.elapsed_time(end) / 20 * 1e3, "graph_us": graph_us}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batches", default="1,32,128,256")
    p.add_argument("--out", default="bench/results/sampler.json")
    args = p.parse_args(argv)
    sampler = Sampler()
    err = check_distribution(sampler)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        t = time_call(sampler, b, args.vocab)
        rows.append({"batch": b, **t})
        print(f"batch {b:4d}: {t['graph_us']:7.1f} us per call in a graph, {t['eager_us']:7.1f} eager")
    write_result(args.out, {"vocab": args.vocab, "distribution_max_abs_err": err, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
