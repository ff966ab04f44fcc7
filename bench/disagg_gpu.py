"""Disaggregated serving on two GPUs, checked end to end (nvidia-h200-x2):

1. router + prefill worker (GPU 0) + decode worker (GPU 1) and, beside it, router + one
   role-``both`` worker (GPU 0), both serving the same preset with the same dummy weights;
2. 200 concurrent greedy requests with shared prefixes through each: token-for-token equality,
   and every worker's block pool whole afterwards;
3. the decode worker killed while KV is in flight: the clients get UNAVAILABLE, the prefill
   worker frees its side, and a restarted decode worker is used again without restarting the
   router or the prefill worker;
4. (``--fleet``) two role-``both`` workers (GPUs 0 and 1) under the router's ``--pd-policy fleet``
   with the TPOT guard on: the same 200 requests, token-for-token equal to the co-located run,
   pools whole, and how many were prefilled on their decode worker and how many shipped;
5. (``--moves``) decodes moved between the two GPUs mid-stream under load (bench/disagg_moves.py):
   outputs equal to the co-located run, the count of moves and the stream gaps they cost, pools whole.

    python -m bench.disagg_gpu --fleet --moves --out bench/results/disagg_h200x2.json
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import tempfile
import time
from pathlib import Path

import grpc

from bench import deployment
from bench.common import write_result
from bench.disagg_moves import moves_check
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

logger = logging.getLogger(__name__)
KILL_PROMPT_LEN = 4000
for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[var] = value


VOCAB_MAX = 100000
# The check sends its 200 requests at once; the router's admission control (on by default) would
# refuse part of that burst, and a refused request proves nothing about equality.
NO_ADMISSION = ["--admission-slo-multiple", "0"]


def make_prompts(n: int, num_prefixes: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(100, VOCAB_MAX) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [prefixes[i % num_prefixes] + [rng.randrange(100, VOCAB_MAX) for _ in range(rng.randint(8, 128))]
            for i in range(n)]


def request(tokens: list[int], max_tokens: int, top_logprobs: int = 0) -> router_pb2.GenerateRequest:
    """Greedy; ``top_logprobs`` > 0 also asks for each position's most likely tokens."""
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens), params=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=top_logprobs > 0, top_logprobs=top_logprobs))


async def run_all(router: str, prompts: list[list[int]], max_tokens: int, timeout: float = 300.0,
                  top_logprobs: int = 0) -> list:
    """Every prompt at once; returns (token ids, first-message latency s) or the error code name,
    and with ``top_logprobs`` > 0 a third item: per token, ``{token id: logprob}`` of its position's
    most likely tokens."""
    async with grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)

        async def one(p):
            start, ttft, ids = time.perf_counter(), None, []
            tops: list[dict[int, float]] = []
            try:
                async for msg in stub.Generate(request(p, max_tokens, top_logprobs), timeout=timeout):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    ids.extend(msg.token_ids)
                    tops.extend(dict(zip(t.token_ids, t.logprobs)) for t in msg.top_logprobs)
                return (ids, ttft, tops) if top_logprobs else (ids, ttft)
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}", None
        return await asyncio.gather(*(one(p) for p in prompts))


def divergence(x: tuple, y: tuple) -> dict:
    """Where two successful, different results first differ (``position``; None when one is a
    prefix of the other) and, when both carry top logprobs there, whether it is a near tie: each
    side's token is among the other's top tokens (``swapped``), with the margin by which each side
    preferred its own token (``margin_*``, logprob; None where the other token is not in that
    side's top list)."""
    i = next((k for k, (u, v) in enumerate(zip(x[0], y[0])) if u != v), None)
    out: dict = {"position": i}
    if i is None or len(x) < 3 or len(y) < 3 or i >= min(len(x[2]), len(y[2])):
        return out
    (u, tx), (v, ty) = (x[0][i], x[2][i]), (y[0][i], y[2][i])
    out.update(tokens=[u, v], swapped=v in tx and u in ty,
               margin_disaggregated=tx[u] - tx[v] if v in tx and u in tx else None,
               margin_co_located=ty[v] - ty[u] if u in ty and v in ty else None)
    return out


def compare(a: list, b: list) -> dict:
    """Token-for-token equality of two runs of the same prompts (``a`` disaggregated, ``b`` the
    reference). With top logprobs in the results (``run_all(top_logprobs=...)``), ``near_ties``
    counts the mismatches whose first differing tokens are swapped top choices, and
    ``divergences`` gives each mismatch's position, tokens and margins."""
    same = sum(x[0] == y[0] for x, y in zip(a, b))
    found = [divergence(x, y) for x, y in zip(a, b)
             if x[0] != y[0] and isinstance(x[0], list) and isinstance(y[0], list)]
    def errors(results: list) -> dict[str, int]:
        counts: dict[str, int] = {}
        for x in results:
            if not isinstance(x[0], list):
                counts[x[0]] = counts.get(x[0], 0) + 1
        return counts
    out = {"requests": len(a), "identical": same, "first_divergence_positions": [d["position"] for d in found][:20],
           "errors": {"disaggregated": errors(a), "co_located": errors(b)}}
    if any(len(x) > 2 for x in a) and any(len(y) > 2 for y in b):
        out["near_ties"] = sum(bool(d.get("swapped")) for d in found)
        out["divergences"] = found[:50]
    return out


def pools_whole(dep: deployment.Deployment) -> dict:
    out = {}
    for addr in dep.decode + dep.prefill:
        s = dep.wait_whole(addr, tries=300)
        out[addr] = {"free": s.num_free_blocks, "total": s.num_total_blocks, "transfers": s.num_kv_transfers,
                     "transfer_bytes": s.kv_transfer_bytes, "preemptions": s.num_preemptions,
                     "prefix_hit_tokens": s.prefix_cache_hit_tokens}
    return out


async def kill_during_transfer(dep: deployment.Deployment, max_tokens: int) -> dict:
    """Long prompts in flight; SIGKILL the decode worker as soon as a first token is out."""
    prompts = make_prompts(8, 8, KILL_PROMPT_LEN, seed=7)
    async with grpc.aio.insecure_channel(dep.router) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        killed = asyncio.Event()

        async def one(p):
            try:
                async for _ in stub.Generate(request(p, max_tokens), timeout=120):
                    if not killed.is_set():
                        dep.services["decode0"].proc.kill()
                        killed.set()
                return "OK"
            except grpc.aio.AioRpcError as e:
                return e.code().name
        started = time.perf_counter()
        codes = await asyncio.gather(*(one(p) for p in prompts))
        answered_s = time.perf_counter() - started
    dep.services["decode0"].proc.wait(30)
    prefill_whole = dep.wait_whole(dep.prefill[0], tries=300)
    return {"client_codes": codes, "all_answered_in_s": answered_s,
            "prefill_free_after_kill": prefill_whole.num_free_blocks, "prefill_total": prefill_whole.num_total_blocks}


async def wait_router_sees_decode(router: str, timeout: float = 120.0) -> float:
    start = time.perf_counter()
    async with grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)
        while time.perf_counter() - start < timeout:
            info = await stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=5)
            if info.num_decode_workers >= 1:
                return time.perf_counter() - start
            await asyncio.sleep(0.5)
    raise TimeoutError("router never saw the restarted decode worker")


def fleet_check(log_dir: Path, gpus: tuple, common: dict, prompts: list, expected: list, max_tokens: int) -> dict:
    """Step 4 of the module docstring: the fleet placement against the co-located outputs."""
    dep = deployment.start(log_dir, num_prefill=0, num_decode=2, decode_role="both",
                           decode_gpus=[*(gpus[0] or []), *(gpus[1] or [])] or None,
                           router_args=["--pd-policy", "fleet", "--slo-tpot-ms", "12", *NO_ADMISSION],
                           **{**common, "extra_worker_args": [*common["extra_worker_args"], "--tpot-target-ms", "12"]})
    try:
        asyncio.run(run_all(dep.router, prompts[:4], max_tokens))
        got = asyncio.run(run_all(dep.router, prompts, max_tokens))
        stats = [dep.stats(w) for w in dep.decode]
        return {"equality": compare(got, expected), "pools_after": pools_whole(dep),
                "kv_transfers_received_and_sent": [s.num_kv_transfers for s in stats],
                "kv_transfer_bytes": [s.kv_transfer_bytes for s in stats]}
    finally:
        dep.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--dtype", default="float32", help="float32 makes greedy ties across batch shapes unlikely")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kv-memory-gb", type=float, default=30.0)
    p.add_argument("--device", default="cuda", help="cpu runs the same checks with Gloo (small presets)")
    p.add_argument("--vocab-max", type=int, default=100000)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--kill-prompt-len", type=int, default=4000)
    p.add_argument("--worker-args", default="", help="more worker flags, e.g. '--async-scheduling on'")
    p.add_argument("--top-logprobs", type=int, default=0,
                   help="ask the 200 requests for each position's N most likely tokens (N >= 2: the equality "
                        "check then tells near ties at the first differing token from other mismatches)")
    p.add_argument("--fleet", action="store_true", help="also check --pd-policy fleet on two both workers")
    p.add_argument("--moves", action="store_true", help="also check decodes moved between the two workers")
    p.add_argument("--move-wave", type=int, default=32, help="--moves: concurrent requests per wave")
    p.add_argument("--move-max-tokens", type=int, default=512, help="--moves: tokens per request")
    p.add_argument("--out", default="bench/results/disagg_h200x2.json")
    args = p.parse_args(argv)
    global VOCAB_MAX, KILL_PROMPT_LEN
    VOCAB_MAX, KILL_PROMPT_LEN = args.vocab_max, args.kill_prompt_len
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_root = Path(tempfile.mkdtemp(prefix="pdserve-disagg-"))
    gpus = (["0"], ["1"]) if args.device == "cuda" else (None, None)
    common = dict(model=args.model, device=args.device, kv_memory_gb=args.kv_memory_gb, timeout=600.0,
                  extra_worker_args=["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
                                     *args.worker_args.split()])
    (log_root / "disagg").mkdir()
    (log_root / "both").mkdir()
    disagg = deployment.start(log_root / "disagg", prefill_gpus=gpus[0], decode_gpus=gpus[1],
                              router_args=NO_ADMISSION, **common)
    both = deployment.start(log_root / "both", num_prefill=0, decode_role="both", decode_gpus=gpus[0],
                            router_args=NO_ADMISSION, **common)
    result: dict = {"config": vars(args)}
    try:
        prompts = make_prompts(args.requests, 10, args.prefix_len)
        for router in (disagg.router, both.router):          # warm-up (JIT, channels), same parameters
            asyncio.run(run_all(router, prompts[:4], args.max_tokens, top_logprobs=args.top_logprobs))
        t0 = time.perf_counter()
        a = asyncio.run(run_all(disagg.router, prompts, args.max_tokens, top_logprobs=args.top_logprobs))
        t1 = time.perf_counter()
        b = asyncio.run(run_all(both.router, prompts, args.max_tokens, top_logprobs=args.top_logprobs))
        t2 = time.perf_counter()
        result["equality"] = compare(a, b)
        result["seconds"] = {"disaggregated": t1 - t0, "co_located": t2 - t1}
        ttfts = sorted(x[1] for x in a if x[1] is not None)
        result["disagg_ttft_p50_s"] = ttfts[len(ttfts) // 2] if ttfts else None
        result["pools_after"] = {"disaggregated": pools_whole(disagg), "co_located": pools_whole(both)}
        result["kill"] = asyncio.run(kill_during_transfer(disagg, args.max_tokens))
        disagg.restart("decode0")
        result["kill"]["router_saw_restart_after_s"] = asyncio.run(wait_router_sees_decode(disagg.router))
        again = asyncio.run(run_all(disagg.router, prompts[:8], args.max_tokens))
        result["kill"]["after_restart_identical"] = sum(x[0] == y[0] for x, y in zip(again, b[:8]))
        result["kill"]["pools_after_restart"] = pools_whole(disagg)
        if args.fleet:
            disagg.stop()
            (log_root / "fleet").mkdir()
            result["fleet"] = fleet_check(log_root / "fleet", gpus, common, prompts, b, args.max_tokens)
        if args.moves:
            disagg.stop()
            (log_root / "moves").mkdir()
            result["moves"] = moves_check(log_root / "moves", [*(gpus[0] or []), *(gpus[1] or [])] or None, common,
                                          both.router, prompts, args.move_max_tokens, args.move_wave)
    finally:
        disagg.stop()
        both.stop()
        for name, log in {**disagg.logs(), **{f"both-{k}": v for k, v in both.logs().items()}}.items():
            text = log.read_text(errors="replace")
            lines = text.splitlines()
            result.setdefault("log_errors", {})[name] = [
                line for line in lines if "Traceback" in line or " ERROR " in line][:5]
            result.setdefault("log_warnings", {})[name] = [line for line in lines if " WARNING " in line][:5]
    write_result(args.out, result)
    eq = result.get("equality", {})
    print(f"identical {eq.get('identical')}/{eq.get('requests')}; kill: {result.get('kill')}")
    if "fleet" in result:
        print(f"fleet: identical {result['fleet']['equality'].get('identical')}/{eq.get('requests')}; "
              f"pools {result['fleet']['pools_after']}; transfers {result['fleet']['kv_transfers_received_and_sent']}")
    if "moves" in result:
        m = result["moves"]
        print(f"moves: {m['moves']:g} moves, identical {m['identical']}/{m['requests']}, pools {m['pools_after']}, "
              f"max gap {m.get('moved_wave_max_gap_ms')} ms (median {m.get('moved_wave_median_gap_ms')} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
