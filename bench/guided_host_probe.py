"""Host time per step of guided decoding, with and without overlapped steps, on the CPU.

    python -m bench.guided_host_probe --batch 64 --max-tokens 32

bench/guided_gpu.py's workload (its JSON Schema, ``--batch`` rows of ``--prompt-len`` random ids,
every row decoding every step) on a one-layer model of Qwen3-0.6B's vocabulary (151,936: every
bitmask and masked logit row has the real width), dummy weights, embedded tokenizer padded to it.
On the CPU the "device" work (forward, logits, sampler) runs synchronously, so it is timed and
taken out; what is left is host time, split into the phases that decide the GPU's critical path:

- ``resolve``: reading a step's tokens and accepting them into the grammars (the engine's
  postprocess without overlap, overlap's ``_write_tokens`` with it);
- ``fill``: the step's token bitmask (StepBitmask.fill);
- ``other``: scheduling, batch preparation, launches, the caller's loop.

Without overlap all three sit between two forwards. With overlap step N+1's forward is enqueued
first, so the GPU waits only for ``resolve + fill`` beyond that forward's own time
(``max(0, resolve + fill - forward)``), and ``other`` is covered by the sampling before it.
A probe, not a test: the numbers depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from bench.guided_gpu import workload
from pdserve.common.engine import LLM, overlap
from pdserve.common.guided.bitmask import StepBitmask
from pdserve.common.guided.state import GuideCompiler
from pdserve.common.loader import PRESET_DIR

SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "float32"}


def model_file(directory: Path) -> str:
    """Qwen3-0.6B's preset, one small layer: the vocabulary is what the host work scales with."""
    config = json.loads((PRESET_DIR / "qwen3-0.6b.json").read_text()) | SMALL
    path = directory / "qwen3-vocab-probe.json"
    path.write_text(json.dumps(config))
    return str(path)


def build(model: str, overlapped: bool, args: argparse.Namespace) -> LLM:
    llm = LLM(model, device="cpu", async_scheduling=overlapped, max_num_seqs=args.batch,
              max_model_len=args.prompt_len + args.max_tokens + 16, num_kv_blocks=args.batch * 40)
    from transformers import AutoTokenizer

    from pdserve.common.default_model import ensure_default_model
    tok = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    llm.engine.guides = GuideCompiler(tok, llm.engine.source.config.vocab_size, [tok.eos_token_id])
    return llm


class Timers:
    """Seconds spent in wrapped callables, by phase."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[phase] += time.perf_counter() - start
        return timed


def measure(llm: LLM, args: argparse.Namespace) -> dict[str, float]:
    """Per-step milliseconds of each phase over one guided generate."""
    eng, runner, t = llm.engine, llm.engine.model_runner, Timers()
    saved = (runner.model.forward, runner.model.compute_logits, runner.sampler.forward, eng.postprocess,
             overlap._write_tokens, StepBitmask.fill)
    runner.model.forward = t.wrap("device", saved[0])
    runner.model.compute_logits = t.wrap("device", saved[1])
    runner.sampler.forward = t.wrap("device", saved[2])
    eng.postprocess = t.wrap("resolve", saved[3])
    overlap._write_tokens = t.wrap("resolve", saved[4])
    StepBitmask.fill = t.wrap("fill", saved[5])       # type: ignore[method-assign]
    prompts, params = workload(args, True)
    try:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
    finally:
        overlap._write_tokens, StepBitmask.fill = saved[4], saved[5]     # type: ignore[method-assign]
        del runner.model.forward, runner.model.compute_logits, runner.sampler.forward, eng.postprocess
    per = 1e3 / args.max_tokens
    out = {k: v * per for k, v in t.total.items()}
    out["other"] = wall * per - sum(out.values())
    out["wall"] = wall * per
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = model_file(Path(d))
        for overlapped in (False, True):
            llm = build(model, overlapped, args)
            args.vocab_size = llm.engine.source.config.vocab_size
            measure(llm, args)                       # warm-up: the grammar's compile, the buffers
            ms = measure(llm, args)
            print(f"overlap {'on ' if overlapped else 'off'}: " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
                  + " ms/step")


if __name__ == "__main__":
    main()
