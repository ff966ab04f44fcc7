"""Tensor-parallel workers served the way users start them, on the CPU (Gloo, real rank
processes): ``pdserve up -tp 2`` with a co-located worker answers exactly what the one-rank
engine generates, and says it runs 2 ranks (Info, GetStats, /metrics); a Reserve from a
prefill worker whose KV cannot pair (other KV heads) is refused with FAILED_PRECONDITION
naming both layouts (test_tensor_parallel_disagg.py ships KV between other splits); a rank
killed mid-stream takes its whole worker down, which the router sees as one dead worker."""
from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import pytest

from bench import deployment
from bench.disagg_gpu import compare, run_all
from pdserve.common.engine import LLM, SamplingParams
from pdserve.loadtest.ports import free_port
from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2, worker_pb2, worker_pb2_grpc

MODEL = "tiny-llama"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    shared = [rng.randrange(3, 500) for _ in range(40)]
    return [shared + [rng.randrange(3, 500) for _ in range(rng.randint(4, 40))] for _ in range(10)]


@pytest.fixture(scope="module")
def expected(prompts) -> list[list[int]]:
    with LLM(MODEL, device="cpu", num_kv_blocks=256) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    metrics = free_port()
    dep = deployment.start_up(tmp_path_factory.mktemp("tp-up"), [
        "--model", MODEL, "--role", "both", "--prefill", "0", "-tp", "2", "--num-kv-blocks", "64",
        "--metrics-port", str(metrics), "--extra-router-args=--admission-slo-multiple 0"])
    dep.metrics["decode0"] = f"127.0.0.1:{metrics + 1}"
    yield dep
    dep.stop()


def _info(address: str, token: str) -> common_pb2.ServerInfo:
    with grpc.insecure_channel(address) as ch:
        return common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10,
                                                          metadata=(("authorization", f"Bearer {token}"),))


def test_up_tp2_worker_equals_one_rank(up, prompts, expected):
    got = asyncio.run(run_all(up.router, prompts, MAX_TOKENS))
    eq = compare([(e, 0.0) for e in expected], got)
    assert eq["identical"] == eq["requests"] == len(prompts), eq
    worker = up.decode[0]
    assert _info(worker, up.internal_token).tensor_parallel_size == 2
    stats = up.stats(worker)
    assert stats.tensor_parallel_size == 2 and stats.num_total_blocks == 64
    assert stats.prefix_cache_hit_tokens > 0
    assert "pdserve:tensor_parallel_size 2.0" in up.scrape("decode0")
    assert up.wait_whole(worker).num_free_blocks == 64
    # the worker and its second rank: two processes under `up` besides the router
    ranks = [p for p in up.services["up"].tree_pids() if "rank_main" in _cmdline(p)]
    assert len(ranks) == 1


def test_reserve_from_a_layout_that_cannot_pair_is_refused(up, prompts):
    """Another split over ranks pairs (its ranks ship to this worker's); other KV heads do not."""
    info = _info(up.decode[0], up.internal_token)
    req = worker_pb2.ReserveRequest(request_id="tp-layout", token_ids=prompts[0],
                                    params=common_pb2.SamplingParams(temperature=0, max_tokens=4),
                                    prefill_tensor_parallel_size=1, prefill_num_kv_heads=info.num_kv_heads + 1,
                                    prefill_head_dim=info.head_dim)
    with grpc.insecure_channel(up.decode[0]) as ch, pytest.raises(grpc.RpcError) as e:
        worker_pb2_grpc.WorkerStub(ch).Reserve(req, timeout=10,
                                               metadata=(("authorization", f"Bearer {up.internal_token}"),))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"TP1 ({info.num_kv_heads + 1} KV heads" in e.value.details()
    assert f"TP2 ({info.num_kv_heads} KV heads" in e.value.details()
    up.wait_whole(up.decode[0])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


LONG = 120


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two co-located TP2 workers behind a router (services started one by one: `up` stops all
    of them when one exits)."""
    dep = deployment.start(tmp_path_factory.mktemp("tp-kill"), model=MODEL, num_prefill=0, num_decode=2,
                           decode_role="both", decode_blocks=64, extra_worker_args=["-tp", "2"], metrics=True,
                           router_args=["--admission-slo-multiple", "0", "--migration-limit", "1"])
    yield dep
    dep.stop()


def _workers_up(dep) -> float:
    for line in dep.scrape("router").splitlines():
        if line.startswith('pdserve_router_workers_up{role="ROLE_BOTH"}'):
            return float(line.split()[-1])
    return -1.0


def test_killed_rank_takes_its_worker_down(pair, prompts):
    """SIGKILL one rank of the worker running a stream: that worker exits (no rank left behind),
    the router counts one decode worker less, the stream goes on on the other worker with the
    one-rank engine's tokens, and that worker's pool is whole afterwards."""
    with LLM(MODEL, device="cpu", num_kv_blocks=256) as llm:
        want = llm.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True),
                            use_tqdm=False)[0].token_ids
    assert _workers_up(pair) == 2
    killed: list[str] = []
    ranks: list[int] = []

    def kill_a_rank_of_its_worker(ids: list[int]) -> None:
        if killed or len(ids) < 8:
            return
        for name in ("decode0", "decode1"):
            if pair.stats(pair.services[name].address).num_running:
                svc = pair.services[name]
                ranks.extend(p for p in svc.tree_pids() if "rank_main" in _cmdline(p))
                os.kill(ranks[0], signal.SIGKILL)
                killed.append(name)
                return

    ids, err = _stream(pair, prompts[3], kill_a_rank_of_its_worker)
    assert killed and len(ranks) == 1, "the stream's worker was not found running it"
    assert err is None and ids == want
    worker = pair.services[killed[0]]
    assert worker.proc.wait(30) == 1                              # the worker ended itself
    assert not worker.tree_pids()                                 # and no rank of it is left
    survivor = next(n for n in ("decode0", "decode1") if n not in killed)
    deadline = time.monotonic() + 30
    while _workers_up(pair) != 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _workers_up(pair) == 1
    pair.wait_whole(pair.services[survivor].address, tries=300)


def _stream(dep, tokens: list[int], on_tokens) -> tuple[list[int], grpc.StatusCode | None]:
    ids: list[int] = []
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens), params=common_pb2.SamplingParams(
        temperature=0, max_tokens=LONG, ignore_eos=True))
    try:
        for msg in dep.router_stub().Generate(req, timeout=180):
            ids.extend(msg.token_ids)
            on_tokens(ids)
    except grpc.RpcError as e:
        return ids, e.code()
    return ids, None
