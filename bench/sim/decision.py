"""The router's routing decision, timed in-process: ``python -m bench.sim.decision``.

Builds the real router objects (``pdserve.router.workers.WorkerRegistry`` with ``WorkerClient``s that
are marked up but never connect, the real ``PrefixIndex`` filled as the workers' KV events would
fill it, a real ``Flow``) for 8 / 16 / 32 / 64 decode workers (prefill = decode / 4) and times
``Placement.choose`` (``flow.placement``) - the whole decision: hashing the prompt, the prefix match,
the decode pick and
the local/remote prefill placement - once per request of a shared-prefix and a multi-turn
workload. No network, no other process, the garbage collector off while timing; each decision
is timed twice: its thread's CPU time (``cpu``: the decision's own cost; other processes on a
shared machine still slow it through caches and clocks, but not by preempting it) and wall time
(``wall``: what it took here, preemptions included). The same seed gives the same requests and
the same index. ``--no-hash-reuse``: the router's ``PromptHasher`` remembers no prompt.

Each worker holds what it would in the scale simulation: a decode worker a few of the system
prompts plus conversation blocks up to its pool (2,048 blocks of 16 tokens), a prefill worker
up to 512 blocks; the load figures are random but fixed by the seed.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

import pdserve.router.placement as placement_mod
from pdserve.common.hashing import block_hash_chain
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.worker_types import Role, WorkerInfo, WorkerStats
from pdserve.loadtest.runner import git_commit
from pdserve.router import pd_policy, policy
from pdserve.router.flow import Flow, Job
from pdserve.router.prefix_index import PrefixIndex, PromptHasher
from pdserve.router.settings import RouterSettings
from pdserve.router.tokenization import ModelSpec, Prompt
from pdserve.router.worker_client import WorkerClient
from pdserve.router.workers import DECODE_ROLES, PREFILL_ROLES, WorkerRegistry

BLOCK = 16
VOCAB = 49152


@dataclass(frozen=True)
class DecisionBenchConfig:
    workers: tuple[int, ...] = (8, 16, 32, 64)
    requests: int = 2000
    system_prompts: int = 16
    system_tokens: int = 1024
    decode_blocks: int = 2048
    prefill_blocks: int = 512
    seed: int = 0
    hash_reuse: bool = True          # False: the router's PromptHasher remembers no prompt

    def __post_init__(self) -> None:
        if not self.workers or min(self.workers) < 1:
            raise ValueError("workers must be a non-empty list of counts >= 1")
        if self.requests < 100:
            raise ValueError("requests must be >= 100 (a p99 needs them)")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _prompts(cfg: DecisionBenchConfig, rng: random.Random, workload: str) -> list[list[int]]:
    systems = [_tokens(rng, cfg.system_tokens) for _ in range(cfg.system_prompts)]
    if workload == "shared-prefix":
        return [systems[rng.randrange(len(systems))] + _tokens(rng, rng.randint(32, 64))
                for _ in range(cfg.requests)]
    out: list[list[int]] = []      # multi-turn: 6 turns, each extends the previous prompt;
    while len(out) < cfg.requests:  # 16 conversations at a time, their turns interleaved
        convs = [systems[rng.randrange(4)][:256] + _tokens(rng, rng.randint(64, 128)) for _ in range(16)]
        for _ in range(6):
            for i, prompt in enumerate(convs):
                out.append(list(prompt))
                convs[i] = prompt + _tokens(rng, rng.randint(128, 256))
    return out[:cfg.requests]


def _client(registry: WorkerRegistry, key: str, role: Role, blocks: int, rng: random.Random) -> None:
    roles = DECODE_ROLES if role is not Role.PREFILL else PREFILL_ROLES
    c = WorkerClient(key, roles, registry.settings, registry.prefix_index, registry._check_info)
    registry.clients[key] = c           # never started: nothing connects
    c.info = WorkerInfo(role=role, block_size=BLOCK, num_kv_blocks=blocks, worker_id=key)
    c.up = True
    c.kv_wanted = True
    used = rng.randrange(blocks // 2, blocks)
    c.stats = WorkerStats(num_used_blocks=used, num_total_blocks=blocks, num_running_context_tokens=used * BLOCK,
                          prefill_tokens_per_s=20000.0, decode_step_ms=10.0, max_num_batched_tokens=8192,
                          chunked_prefill=True)
    c.inflight = rng.randrange(0, 8)
    c.inflight_tokens = c.inflight * rng.randrange(200, 1500)
    c.inflight_prompt_tokens = rng.randrange(0, 4000) if role is Role.PREFILL else 0
    c.other_tokens = rng.randrange(0, 4000)
    c.prefill_counter = rng.uniform(0, 20000) if role is Role.PREFILL else 0.0   # recent work (pd_policy's W)
    c.prefill_counter_at = time.monotonic() - rng.uniform(0, 2)
    c.sync_figures()


def _fill(index: PrefixIndex, key: str, blocks: int, prompts: list[list[int]], rng: random.Random) -> None:
    """A snapshot as the worker would send it: some of the workload's prompts, up to its pool."""
    held: list[int] = []
    for p in rng.sample(prompts, min(len(prompts), 64)):
        held.extend(block_hash_chain(p, BLOCK))
        if len(held) >= blocks:
            break
    index.apply(key, held[:blocks], snapshot=True, seq=1, capacity=blocks)


def build(cfg: DecisionBenchConfig, num_decode: int, prompts: list[list[int]], routing: str = "kv"
          ) -> tuple[Flow, WorkerRegistry]:
    """A Flow over ``num_decode`` decode and ``num_decode // 4`` prefill workers (must run in a loop)."""
    rng = random.Random(cfg.seed + num_decode)
    settings = RouterSettings(router_id="bench", block_size=BLOCK, routing=routing)
    registry = WorkerRegistry(settings, ModelSpec(name="sim", max_model_len=8192, vocab_size=VOCAB), [], [])
    for i in range(num_decode):
        _client(registry, f"10.0.0.{i}:50051", Role.DECODE, cfg.decode_blocks, rng)
    for i in range(max(1, num_decode // 4)):
        _client(registry, f"10.0.1.{i}:50051", Role.PREFILL, cfg.prefill_blocks, rng)
    if not cfg.hash_reuse:
        registry.prefix_index.hasher = PromptHasher(max_prompts=0)
    for key, c in registry.clients.items():
        _fill(registry.prefix_index, key, cfg.decode_blocks if c.can_decode else cfg.prefill_blocks, prompts, rng)
    return Flow(registry, settings, tokenizer=None, metrics=None), registry


def _job(tokens: list[int]) -> Job:
    return Job("r", Prompt(tokens, "prompt_token_ids"), SamplingParams())


def time_decisions(flow: Flow, prompts: list[list[int]]) -> dict:
    """Times ``Placement.choose`` per request (a fresh Job each: its hash chain is computed inside)."""
    jobs = [_job(p) for p in prompts]
    for j in jobs[:50]:                       # warm-up (caches, first-call paths)
        flow.placement.choose(_job(j.prompt.token_ids), set())
    cpu, wall = [], []
    gc.disable()
    try:
        for j in jobs:
            w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            flow.placement.choose(j, set())
            c1, w1 = time.thread_time_ns(), time.perf_counter_ns()
            cpu.append(c1 - c0)
            wall.append(w1 - w0)
    finally:
        gc.enable()
    return {"requests": len(jobs), "cpu": _percentiles(cpu), "wall": _percentiles(wall)}


def _percentiles(ns: list[int]) -> dict:
    us = sorted(t / 1000 for t in ns)
    return {"p50_us": round(us[len(us) // 2], 1), "p90_us": round(us[int(len(us) * 0.9)], 1),
            "p99_us": round(us[int(len(us) * 0.99)], 1), "mean_us": round(statistics.fmean(us), 1)}


def time_parts(flow: Flow, prompts: list[list[int]]) -> dict:
    """Mean thread CPU time (us) of the decision's parts over the requests: hashing the prompt
    (``PromptHasher``, the requests in order, as the router sees them),
    the prefix match, the decode pick (``Placement.choose_decode``) and the prefill placement
    (``Placement.place_prefill``), each run alone; ``decode_policy`` / ``prefill_policy``: of those,
    ``pick_decode_workers`` / ``decide_workers`` alone on the arguments the flow passed them for
    the same requests (the rest is the flow's own work)."""
    registry = flow.registry
    index = registry.prefix_index
    chains = [block_hash_chain(p, BLOCK) for p in prompts]
    jobs = [_job(p) for p in prompts]
    for j, c in zip(jobs, chains):
        j.hash_chain = c
        j.match(index, BLOCK)
    decode = registry.decode_workers()[0]
    prefillers = [c for c in registry.prefill_workers() if c is not decode]
    hasher = PromptHasher() if flow.registry.prefix_index.hasher.max_prompts else PromptHasher(max_prompts=0)
    parts = {"hash": lambda i: hasher.chain(prompts[i], BLOCK), "match": lambda i: index.match(chains[i]),
             "decode_pick": lambda i: flow.placement.choose_decode(jobs[i], registry.decode_workers(), 0),
             "prefill_placement": lambda i: flow.placement.place_prefill(jobs[i], decode, prefillers, 0)}
    picks, decides = _captured(flow, jobs, decode, prefillers)
    parts["decode_policy"] = lambda i: policy.pick_decode_workers(*picks[i])
    parts["prefill_policy"] = lambda i: pd_policy.decide_workers(*decides[i])
    out = {}
    for name, fn in parts.items():
        t0 = time.thread_time_ns()
        for i in range(len(prompts)):
            fn(i)
        out[name] = round((time.thread_time_ns() - t0) / len(prompts) / 1000, 1)
    return out


def _captured(flow: Flow, jobs: list[Job], decode, prefillers) -> tuple[list[tuple], list[tuple]]:
    """The arguments of each request's ``pick_decode_workers`` and ``decide_workers`` calls, as the
    flow makes them."""
    picks: list[tuple] = []
    decides: list[tuple] = []
    saved = placement_mod.pick_decode_workers, placement_mod.decide_workers
    placement_mod.pick_decode_workers = lambda *a: picks.append(a) or saved[0](*a)
    placement_mod.decide_workers = lambda *a: decides.append(a) or saved[1](*a)
    try:
        for j in jobs:
            flow.placement.choose_decode(j, flow.registry.decode_workers(), 0)
            flow.placement.place_prefill(j, decode, prefillers, 0)
    finally:
        placement_mod.pick_decode_workers, placement_mod.decide_workers = saved
    return picks, decides


async def _run(cfg: DecisionBenchConfig, workloads: list[str]) -> dict:
    out: dict = {"config": cfg.__dict__ | {"workers": list(cfg.workers)}, "results": []}
    for workload in workloads:
        prompts = _prompts(cfg, random.Random(cfg.seed), workload)
        for n in cfg.workers:
            flow, registry = build(cfg, n, prompts)
            row = {"workload": workload, "decode_workers": n, "prefill_workers": max(1, n // 4),
                   "index_hashes": registry.prefix_index.num_hashes(), **time_decisions(flow, prompts),
                   "parts_mean_cpu_us": time_parts(flow, prompts)}
            out["results"].append(row)
            print(json.dumps(row), flush=True)
            await registry.stop()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="8,16,32,64")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--workloads", default="shared-prefix,multi-turn")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--no-hash-reuse", action="store_true",
                    help="hash every prompt whole (PromptHasher with no memory), for comparison")
    args = ap.parse_args(argv)
    cfg = DecisionBenchConfig(workers=tuple(int(x) for x in args.workers.split(",")), requests=args.requests,
                              hash_reuse=not args.no_hash_reuse)
    result = asyncio.run(_run(cfg, args.workloads.split(",")))
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join(["python -m bench.sim.decision", *(argv if argv is not None else sys.argv[1:])]),
              "commit": git_commit(), **result}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
