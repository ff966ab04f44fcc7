"""Lab probe: a decode step as two half-batches on two CUDA streams inside one graph.

A decode step of the small models is mostly attention (reading the KV cache at the copy
bandwidth) plus ~10 latency-bound kernels per layer (four GEMMs at ~3x their bytes floor, the
elementwise kernels). Running the two halves of the batch as two independent forwards on two
streams lets one half's attention fill the gaps of the other half's small kernels, at the price
of reading the weights twice. This probe times, for each (batch, context) point, the engine's
own graph against a two-stream graph over the same static buffers, and checks the hidden states
agree. The rows of a ragged point are sorted longest first and dealt alternately to the halves.

    python -m bench.two_stream_probe --out bench/results/two_stream_probe_h100.json
"""
from __future__ import annotations

import argparse
import random

import torch

from bench.common import copy_bandwidth, write_result
from bench.decode_step import build_ragged_batch, time_step
from pdserve.common.context import ForwardContext, forward_context
from pdserve.common.engine import LLM
from pdserve.common.ops.paged_attention import DECODE_MAX_SPLITS, alloc_decode_workspace, decode_num_splits


class TwoStreamStep:
    """One graph: rows [0, h) on stream A, rows [h, bs) on stream B, over the engine's static
    decode buffers (filled by a replay of the engine's own graph first)."""

    def __init__(self, llm: LLM, bs: int) -> None:
        mr = llm.engine.model_runner
        self.gr, self.model, self.bs, self.h = mr.graph_runner, mr.model, bs, bs // 2
        cfg, dev = self.model.config, self.gr.input_ids.device
        self.ws = [alloc_decode_workspace(self.bs, cfg.num_attention_heads, cfg.head_dim, DECODE_MAX_SPLITS, dev)
                   for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.graph = torch.cuda.CUDAGraph()
        self.out: torch.Tensor | None = None

    def _ctx(self, lo: int, hi: int, ws: torch.Tensor) -> ForwardContext:
        gr, cfg = self.gr, self.model.config
        splits = decode_num_splits(hi - lo, cfg.num_key_value_heads, gr.max_context_len, gr.input_ids.device)
        return ForwardContext(is_prefill=False, slot_mapping=gr.slot_mapping[lo:hi],
                              context_lens=gr.context_lens[lo:hi], block_tables=gr.block_tables[lo:hi],
                              max_context_len=gr.max_context_len, decode_workspace=ws, decode_num_splits=splits)

    def _forward(self) -> torch.Tensor:
        gr, main = self.gr, torch.cuda.current_stream()
        outs = []
        for (lo, hi), ws, stream in zip(((0, self.h), (self.h, self.bs)), self.ws, self.streams):
            stream.wait_stream(main)
            with torch.cuda.stream(stream), forward_context(self._ctx(lo, hi, ws)):
                outs.append(self.model(gr.input_ids[lo:hi], gr.positions[lo:hi]))
        for stream in self.streams:
            main.wait_stream(stream)
        return torch.cat(outs)                               # [bs, H]

    @torch.inference_mode()
    def capture(self) -> None:
        self._forward()                                       # warm-up: compiles the half-batch kernels
        torch.cuda.synchronize()
        with torch.cuda.graph(self.graph):
            self.out = self._forward()
        torch.cuda.synchronize()

    def time(self, iters: int = 30) -> dict:
        for _ in range(5):
            self.graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        times.sort()
        return {"median_s": times[len(times) // 2], "min_s": times[0]}


def point(llm: LLM, contexts: list[int], label: str) -> dict:
    seqs = build_ragged_batch(llm, contexts)
    mr, bs = llm.engine.model_runner, len(contexts)
    input_ids, positions, ctx = mr.prepare_decode(seqs)
    one = time_step(llm, seqs, iters=30)                      # also leaves the batch in the static buffers
    ref = mr.graph_runner.run(input_ids, positions, ctx).float().clone()
    two = TwoStreamStep(llm, bs)
    two.capture()
    t2 = two.time()
    assert two.out is not None
    got = two.out.float()
    err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1).min().item()
    for s in seqs:
        llm.engine.block_manager.deallocate(s)
    gain = one["median_s"] / t2["median_s"] - 1
    print(f"{label:>22s}: one graph {1e3 * one['median_s']:.3f} ms, two streams {1e3 * t2['median_s']:.3f} ms "
          f"({100 * gain:+.1f}%), max rel diff {err:.2e}, min cos {cos:.6f}")
    return {"label": label, "batch": bs, "contexts": [min(contexts), max(contexts)], "one_graph": one,
            "two_streams": t2, "speedup": gain, "max_rel_diff": err, "min_row_cosine": cos}


def ragged(bs: int, lo: int, hi: int, seed: int = 1) -> list[int]:
    """Contexts uniform in [lo, hi], longest first, dealt alternately so each half is balanced."""
    rng = random.Random(seed)
    ctx = sorted((rng.randint(lo, hi) for _ in range(bs)), reverse=True)
    return ctx[0::2] + ctx[1::2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--out", default="bench/results/two_stream_probe.json")
    args = p.parse_args(argv)
    bandwidth = copy_bandwidth()
    llm = LLM(args.model, block_size=256, max_num_seqs=512, max_model_len=4096)
    points = [point(llm, [600] * 256, "b=256 ctx=600"),
              point(llm, [1200] * 256, "b=256 ctx=1200"),
              point(llm, ragged(256, 200, 2000), "b=256 ragged 200-2000"),
              point(llm, ragged(192, 600, 2000), "b=192 ragged 600-2000"),
              point(llm, ragged(128, 600, 2000), "b=128 ragged 600-2000"),
              point(llm, ragged(64, 800, 2000), "b=64 ragged 800-2000"),
              point(llm, [1200] * 32, "b=32 ctx=1200")]
    write_result(args.out, {"model": args.model, "copy_bandwidth_GBps": bandwidth / 1e9, "points": points})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
