"""Decodes that move, on two GPUs (step 5 of bench/disagg_gpu.py, ``--moves``).

Two role-``both`` workers (GPUs 0 and 1) under ``--pd-policy fleet`` with a TPOT objective far below
any step (1 ms), so a worker with two rows more than an idle one is always "at risk" and the mover
(every 0.2 s) sends decodes over. Sequence: worker 1 is killed and restarted (it reloads its model),
and waves of concurrent greedy requests run meanwhile; they all decode on worker 0 until worker 1 is
back, then the mover moves some of them to worker 1 mid-stream (prefilled again on worker 0 from
its prefix cache, KV shipped over NCCL). The waves stop after the first wave that saw moves.

Shows: every output equal to the same request on a co-located single worker (never moved), the
router's move count, the largest gap between two messages of a stream in the wave with moves (the
cost of a move is in it) against that wave's median gap, and both pools whole afterwards.
"""
from __future__ import annotations

import asyncio
import re
import statistics
import time
from pathlib import Path

import grpc

from bench import deployment
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

MOVE_ROUTER_ARGS = ["--pd-policy", "fleet", "--slo-tpot-ms", "1", "--pd-move-interval-s", "0.2"]
MAX_WAVES = 12


def _request(tokens: list[int], max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens), params=common_pb2.SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True))


async def timed_streams(router: str, prompts: list[list[int]], max_tokens: int) -> list[tuple]:
    """Every prompt at once: (token ids or the error, the message arrival times in s)."""
    async with grpc.aio.insecure_channel(router) as ch:
        stub = router_pb2_grpc.GenerationStub(ch)

        async def one(p: list[int]) -> tuple:
            ids: list[int] = []
            times: list[float] = []
            try:
                async for msg in stub.Generate(_request(p, max_tokens), timeout=300):
                    times.append(time.perf_counter())
                    ids.extend(msg.token_ids)
                return ids, times
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}", times
        return await asyncio.gather(*(one(p) for p in prompts))


def moves(dep: deployment.Deployment) -> float:
    total = 0.0
    for line in dep.scrape("router").splitlines():
        m = re.match(r'pdserve_router_pd_decisions_total\{(.*)\} (\S+)$', line)
        if m and 'reason="move"' in m.group(1):
            total += float(m.group(2))
    return total


def _decode_workers_up(router: str) -> int:
    with grpc.insecure_channel(router) as ch:
        info = router_pb2_grpc.GenerationStub(ch).GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=10)
    return info.num_decode_workers


def _wait(cond, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("moves check: timed out waiting for the router")
        time.sleep(0.2)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def moves_check(log_dir: Path, gpus: list[str] | None, common: dict, reference_router: str,
                prompts: list[list[int]], max_tokens: int, wave: int) -> dict:
    """The module docstring's sequence; ``reference_router`` serves the unmoved outputs."""
    dep = deployment.start(log_dir, num_prefill=0, num_decode=2, decode_role="both", decode_gpus=gpus, metrics=True,
                           router_args=[*MOVE_ROUTER_ARGS, "--admission-slo-multiple", "0"], **common)
    try:
        asyncio.run(timed_streams(dep.router, prompts[:2], 8))          # warm-up
        dep.kill("decode1")
        _wait(lambda: _decode_workers_up(dep.router) == 1, 60)
        dep.restart("decode1")
        waves, sent, moved_wave = [], 0, None
        while moved_wave is None and len(waves) < MAX_WAVES:
            batch = [prompts[(sent + i) % len(prompts)] for i in range(wave)]
            before = moves(dep)
            got = asyncio.run(timed_streams(dep.router, batch, max_tokens))
            waves.append((batch, got, moves(dep) - before))
            sent += wave
            if waves[-1][2] > 0:
                moved_wave = len(waves) - 1
        stats = [dep.stats(w) for w in dep.decode]
        out = {"waves": len(waves), "requests": sent, "moves": moves(dep), "moved_in_wave": moved_wave,
               "kv_transfers": [s.num_kv_transfers for s in stats], "pools_after": _pools(dep)}
    finally:
        dep.stop()
    batch = [p for b, _, _ in waves for p in b]
    reference = asyncio.run(timed_streams(reference_router, batch, max_tokens))
    got = [g for _, gs, _ in waves for g in gs]
    out["identical"] = sum(a[0] == b[0] for a, b in zip(got, reference))
    out["errors"] = [g[0] for g in got if not isinstance(g[0], list)][:5]
    if moved_wave is not None:
        gaps = [_gaps(t) for _, t in waves[moved_wave][1]]
        out["moved_wave_max_gap_ms"] = 1000 * max(max(g, default=0.0) for g in gaps)
        out["moved_wave_median_gap_ms"] = 1000 * statistics.median([x for g in gaps for x in g] or [0.0])
        out["moved_wave_stream_max_gaps_ms"] = sorted((round(1000 * max(g, default=0.0), 1) for g in gaps),
                                                      reverse=True)[:8]
    return out


def _pools(dep: deployment.Deployment) -> dict:
    out = {}
    for addr in dep.decode:
        s = dep.wait_whole(addr, tries=300)
        out[addr] = {"free": s.num_free_blocks, "total": s.num_total_blocks}
    return out
