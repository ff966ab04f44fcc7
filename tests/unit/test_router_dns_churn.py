"""Worker churn through DNS re-resolution, under load, as in Kubernetes (a headless Service's
pods: one port, one IP each): the router's real registry and request flow (in this process,
``resolve`` answering from a list the test changes) in front of three scripted workers, real
gRPC servers in processes of their own on 127.0.0.1 / .2 / .3, same port.

While requests stream: a pod is added to the answer (it gets traffic), a pod leaves the answer
(retired: no new requests, closed once idle) and is then killed, as its pod would be. Every
request completes with the scripted tokens, none lost, and the retired worker is gone from the
registry."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve.router.workers as workers_mod
from pdserve.loadtest.ports import free_port
from pdserve.loadtest.scripted_state import script_token
from pdserve.router.metrics import RouterMetrics
from pdserve.router.observed import ObservedFlow
from pdserve.router.servicer import GenerationServicer
from pdserve.router.settings import RouterSettings
from pdserve.router.tokenization import ModelSpec
from pdserve.router.workers import WorkerRegistry
from pdserve.v1 import common_pb2, router_pb2

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
MAX_TOKENS = 6
SPEC = ModelSpec("tiny-llama", max_model_len=1024, vocab_size=VOCAB)
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@pytest.fixture()
def pods(tmp_path):
    port = free_port()   # free on 0.0.0.0: on every loopback host
    procs = {}
    for h in HOSTS:
        log = open(tmp_path / f"{h}.log", "w")
        procs[h] = subprocess.Popen(
            [sys.executable, "-m", "pdserve.loadtest.scripted_worker", "--host", h, "--advertise", h,
             "--port", str(port), "--role", "both", "--model", "tiny-llama", "--vocab", str(VOCAB),
             "--max-model-len", "1024", "--step-ms", "20"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield port, procs
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def test_dns_pods_added_and_removed_under_load(monkeypatch, pods) -> None:
    port, procs = pods
    answer = [f"{HOSTS[0]}:{port}", f"{HOSTS[1]}:{port}"]

    async def fake_resolve(host: str, p: int) -> list[str]:
        assert (host, p) == ("pods.test", port)
        return sorted(answer)

    monkeypatch.setattr(workers_mod, "resolve", fake_resolve)

    async def scenario() -> None:
        settings = RouterSettings("r-dns", dns_refresh_s=0.2, worker_timeout_s=2.0)
        registry = WorkerRegistry(settings, SPEC, [], f"dns:///pods.test:{port}")
        flow = ObservedFlow(registry, settings, None, RouterMetrics())
        front = GenerationServicer(flow, registry, SPEC, None)
        served: dict[str, int] = {}
        flow_dispatched = flow.dispatched

        def count(att) -> None:
            served[att.decode.key] = served.get(att.decode.key, 0) + 1
            flow_dispatched(att)

        flow.dispatched = count
        await registry.start(initial_wait_s=20)
        for _ in range(200):
            if len(registry.decode_workers()) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(registry.decode_workers()) == 2

        async def one(i: int) -> tuple[list[int], list[int]]:
            ids = [(i * 7 + k) % (VOCAB - 3) + 3 for k in range(20 + i % 9)]
            req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                             params=common_pb2.SamplingParams(max_tokens=MAX_TOKENS))
            out: list[int] = []
            async for msg in flow.generate(front.job(req, 60.0)):
                out.extend(msg.token_ids)
            return ids, out

        async def load(first: int, n: int) -> list:
            sem = asyncio.Semaphore(6)

            async def limited(i: int):
                async with sem:
                    return await one(i)
            return await asyncio.gather(*(limited(i) for i in range(first, first + n)), return_exceptions=True)

        running = asyncio.create_task(load(0, 90))
        await asyncio.sleep(0.5)
        answer.append(f"{HOSTS[2]}:{port}")                      # a pod scheduled
        await asyncio.sleep(1.0)
        answer.remove(f"{HOSTS[0]}:{port}")                      # a pod deleted: out of DNS first...
        await asyncio.sleep(0.6)
        procs[HOSTS[0]].send_signal(signal.SIGTERM)              # ...then terminated (drains)
        results = await running
        results += await load(90, 30)                             # after the churn
        failed = [r for r in results if isinstance(r, BaseException)]
        assert not failed, failed[:3]
        for ids, out in results:
            assert out == [script_token(ids, k, VOCAB) for k in range(MAX_TOKENS)]
        assert served.get(f"{HOSTS[0]}:{port}", 0) > 0, served   # the removed pod had traffic
        assert served.get(f"{HOSTS[2]}:{port}", 0) > 0, served   # the added pod got traffic
        late = [k for k, v in served.items() if v]
        assert len(late) == 3, served
        for _ in range(100):
            if f"{HOSTS[0]}:{port}" not in registry.clients:
                break
            await asyncio.sleep(0.05)
        assert sorted(registry.clients) == [f"{HOSTS[1]}:{port}", f"{HOSTS[2]}:{port}"]
        await registry.stop()

    asyncio.run(scenario())
