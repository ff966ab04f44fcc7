"""The placement lab's model (bench/pd_lab.py): modelled GPUs (:class:`GpuModel`), requests
(:class:`Req`) and workers (:class:`Worker`) in simulated time, the served benchmark's metrics over
them, and the benchmark's workloads as lab requests."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.engine.step_timer import StepTimer
from pdserve.common.engine.tpot_guard import TpotGuard
from pdserve.loadtest import arrivals, datasets, phases
from pdserve.router import pd_policy as pd

WORKLOADS: dict[str, dict[str, Any]] = {     # bench/gpu_capacity.sh's three workloads, and a mix
    "prefill-heavy": dict(name="prefill-heavy", input_len="2000:4000", output_len="100:300"),
    "decode-heavy": dict(name="decode-heavy", input_len="200:800", output_len="500:1500"),
    "shared-prefix": dict(name="shared-prefix", num_prefixes=16, prefix_len=2000, input_len="100:500",
                          output_len="100:500"),
    "mixed": dict(name="random", input_len="200:4000", output_len="100:1000"),   # a lab-only check, none named
}


@dataclass(frozen=True)
class GpuModel:
    """Step times (ms) of the Qwen3-8B geometry on one H200 (module docstring)::

        step = fixed + per_seq * rows + max(weights, prompt_tokens * ms_per_prompt_token)
               + kv * context_tokens / 1000

    A step's weights are read once for its decode rows and its prompt tokens together, so prompt
    tokens cost only what their compute exceeds the weight read by (a decode step reads the 16 GB
    of weights; 512 prompt tokens of compute take ~12 ms). Except with ``linear_mixed``: a step
    with decode rows and prompt tokens takes its decode step plus ``ms_per_chunk_token`` a prompt
    token, as the engine's step-time lines showed on two H100s (decode 9.66 ms, mixed 10.36 ms with
    34 prompt tokens; decode 8.55, mixed 15.27 with 268: ~0.021-0.026 ms a token from the first)."""
    fixed_ms: float = 2.0
    per_seq_ms: float = 0.0                # a decode row's own work (attention launch share, sampling)
    weights_ms: float = 3.4                # 16.4 GB at ~4.8 TB/s
    kv_ms_per_ktok: float = 0.027          # 147 KB of KV a token
    ms_per_prompt_token: float = 0.025     # ~15 GFLOP a token at ~600 TFLOP/s (a prefill worker's batches)
    ms_per_chunk_token: float = 0.028      # the same in the smaller GEMMs of a chunked step
    transfer_ms: float = 2.0
    transfer_us_per_token: float = 1.0
    linear_mixed: bool = False
    prefix_reread: float = 1.0             # of a shared prefix, what its other readers in a step read

    @classmethod
    def named(cls, gpu: str) -> GpuModel:
        """``h200`` (the fitted model) or ``h100``: the reads at 3.0 TB/s instead of 4.8 (16.4 GB of
        weights: 5.5 ms; KV 0.043 ms per 1,000 tokens), mixed steps linear at 0.017 ms a prompt
        token and a prefill worker's 0.0275 (fitted to the device's prefill-heavy runs of 1P1D at
        8/11/13 req/s and co-location at 8/11), a shared prefix's other readers in a step
        reading 0.6 of it (fitted to co-location's shared-prefix phase of `phases` at base 8:
        bench/notes/placement.md, "Fifth session")."""
        return cls() if gpu == "h200" else cls(weights_ms=5.5, kv_ms_per_ktok=0.043, linear_mixed=True,
                                               ms_per_chunk_token=0.017, ms_per_prompt_token=0.0275,
                                               prefix_reread=0.6)

    def step_ms(self, rows: int, context_tokens: int, prompt_tokens: int, chunked: bool) -> float:
        per_token = self.ms_per_chunk_token if chunked else self.ms_per_prompt_token
        dense = max(self.weights_ms, prompt_tokens * per_token)
        if self.linear_mixed and rows and prompt_tokens:
            dense = self.weights_ms + prompt_tokens * self.ms_per_chunk_token
        return self.fixed_ms + self.per_seq_ms * rows + dense + self.kv_ms_per_ktok * context_tokens / 1000.0


@dataclass(eq=False)
class Req:
    arrival: float
    prompt_len: int
    out_len: int
    prefix: int | None
    decode_worker: Worker | None = None
    tokens: list[float] = field(default_factory=list)      # times of its output tokens
    tpot_slo_ms: float = 0.0                                # its own TPOT target (TpotGuard reads it)


@dataclass(eq=False)
class Worker:
    key: str
    role: str                                   # prefill | decode | both
    budget: int
    queue: deque = field(default_factory=deque) # [req, tokens left] to compute here
    rows: list = field(default_factory=list)    # requests decoding here
    cached: set = field(default_factory=set)    # shared prompts held
    timer: StepTimer = field(default_factory=StepTimer)
    stats: tuple = (0.0, 0.0, 0.0)              # polled (decode_step_ms, mixed_step_ms, prefill_tokens_per_s)
    counter: float = 0.0                        # prompt tokens given lately (decayed) ...
    counter_at: float = 0.0                     # ... as of this time
    busy: bool = False
    guard: TpotGuard | None = None              # the engine's TPOT guard (its own timer); None = off
    mixed: int = 0                              # budget of a step with decode rows; 0 = budget

    @property
    def mixed_budget(self) -> int:
        return self.mixed or self.budget

    def give(self, tokens: int, now: float, window: float) -> None:
        self.counter = pd.decayed_rate(self.counter, self.counter_at, now, window) + tokens
        self.counter_at = now

    def queued_tokens(self) -> int:
        return sum(left for _, left in self.queue)


def metrics(reqs: list[Req], slo_ttft: float, slo_tpot: float, itl_p99_ms: float) -> dict:
    """The served benchmark's figures (pdserve.loadtest.metrics): attainment of TTFT and TPOT (mean
    time per output token after the first), ITL p99 over every gap."""
    ok, gaps, ttfts, tpots = 0, [], [], []
    for r in reqs:
        ttft = (r.tokens[0] - r.arrival) * 1e3
        tpot = (r.tokens[-1] - r.tokens[0]) * 1e3 / (len(r.tokens) - 1) if len(r.tokens) > 1 else 0.0
        ok += ttft <= slo_ttft and tpot <= slo_tpot
        ttfts.append(ttft)
        tpots.append(tpot)
        gaps += [(b - a) * 1e3 for a, b in zip(r.tokens, r.tokens[1:])]
    gaps.sort()
    itl_p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0
    return {"slo_attainment": ok / len(reqs), "itl_p99_ms": itl_p99, "itl_p99_ok": itl_p99 <= itl_p99_ms,
            "mean_ttft_ms": sum(ttfts) / len(ttfts), "mean_tpot_ms": sum(tpots) / len(tpots)}


def requests_at(workload: str, n: int, rate: float, variant: int, phase_seconds: float = 45.0) -> list[Req]:
    if workload == "phases":       # the load tool's phases schedule: its own arrival times
        sched = phases.build(n, rate, seed=0, variant=variant, phase_seconds=phase_seconds, vocab=151936)
        return [Req(float(t), b.prompt_len, b.output_len, b.extra.get("prefix"))
                for t, b in zip(sched.offsets, sched.requests)]
    w = dict(WORKLOADS[workload])
    built = datasets.build(w.pop("name"), num_prompts=n, vocab=151936, variant=variant, **w)
    times = arrivals.arrival_times(n, rate, seed=0)
    return [Req(float(t), b.prompt_len, b.output_len, b.extra.get("prefix")) for t, b in zip(times, built)]
