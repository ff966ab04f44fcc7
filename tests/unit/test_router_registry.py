"""Router internals on an event loop, without worker processes: DNS discovery in the registry,
registration checks, and step merging in an attempt (several queued outputs -> one message)."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pdserve.router.workers as workers_mod  # noqa: E402
from pdserve.common.outputs import FinishReason, SequenceOutput  # noqa: E402
from pdserve.common.worker_types import Role, WorkerInfo  # noqa: E402
from pdserve.router.attempt import Attempt  # noqa: E402
from pdserve.router.settings import RouterSettings  # noqa: E402
from pdserve.router.tokenization import ModelSpec  # noqa: E402
from pdserve.router.workers import WorkerRegistry  # noqa: E402
from pdserve.v1 import worker_pb2  # noqa: E402

SPEC = ModelSpec("m", max_model_len=1024, vocab_size=512)


def test_dns_refresh_adds_retires_and_closes(monkeypatch) -> None:
    answers = [["10.0.0.1:7", "10.0.0.2:7"], ["10.0.0.2:7", "10.0.0.3:7"]]

    async def fake_resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("pods.svc", 7)
        return answers.pop(0)

    monkeypatch.setattr(workers_mod, "resolve", fake_resolve)

    async def scenario() -> None:
        reg = WorkerRegistry(RouterSettings("r", worker_timeout_s=0.2), SPEC, [], "dns:///pods.svc:7")
        target = workers_mod.split_dns_target("dns:///pods.svc:7")
        await reg._refresh("dns:///pods.svc:7", target, workers_mod.DECODE_ROLES)
        assert sorted(reg.clients) == ["10.0.0.1:7", "10.0.0.2:7"]
        reg.clients["10.0.0.1:7"].inflight = 1          # busy: retired, kept until idle
        await reg._refresh("dns:///pods.svc:7", target, workers_mod.DECODE_ROLES)
        assert sorted(reg.clients) == ["10.0.0.1:7", "10.0.0.2:7", "10.0.0.3:7"]
        assert reg.clients["10.0.0.1:7"].retired and not reg.clients["10.0.0.2:7"].retired
        reg.clients["10.0.0.1:7"].inflight = 0
        answers.append(["10.0.0.2:7", "10.0.0.3:7"])
        await reg._refresh("dns:///pods.svc:7", target, workers_mod.DECODE_ROLES)
        assert sorted(reg.clients) == ["10.0.0.2:7", "10.0.0.3:7"]
        await reg.stop()

    asyncio.run(scenario())


def test_registration_checks() -> None:
    async def scenario() -> None:
        reg = WorkerRegistry(RouterSettings("r", block_size=16), SPEC, "p:1", "d:1")
        dec = SimpleNamespace(key="d:1", expected_roles=workers_mod.DECODE_ROLES)
        pre = SimpleNamespace(key="p:1", expected_roles=workers_mod.PREFILL_ROLES)
        ok = WorkerInfo(protocol_version="v1", role=Role.DECODE, block_size=16, vocab_size=512)
        assert reg._check_info(dec, ok) is None
        assert reg._check_info(pre, ok) == "role decode, expected prefill (check --prefill / --decode)"
        assert "block_size" in reg._check_info(dec, WorkerInfo(
            protocol_version="v1", role=Role.BOTH, block_size=32))
        assert "vocab_size" in reg._check_info(dec, WorkerInfo(
            protocol_version="v1", role=Role.BOTH, block_size=16, vocab_size=1000))
        assert "protocol_version" in reg._check_info(dec, WorkerInfo(
            protocol_version="v2", role=Role.DECODE, block_size=16))
        assert "role unspecified" in reg._check_info(dec, WorkerInfo(protocol_version="v1", block_size=16))
        learn = WorkerRegistry(RouterSettings("r"), SPEC, "", "")
        assert learn._check_info(dec, WorkerInfo(protocol_version="v1", role=Role.BOTH, block_size=32)) is None
        assert learn.block_size == 32

    asyncio.run(scenario())


def test_queued_outputs_merge_into_one_step() -> None:
    async def scenario() -> None:
        decode = SimpleNamespace(key="d", add_load=lambda *a, **k: None, mark_down=lambda *a: None)
        job = SimpleNamespace(prompt=SimpleNamespace(token_ids=[1, 2, 3]), expired=lambda: False,
                              sampling=SimpleNamespace(logprobs=True))
        att = Attempt(SimpleNamespace(), job, decode, None, "rid")
        att.queue = asyncio.Queue()
        for i, reason in ((5, None), (6, None), (7, FinishReason.LENGTH)):
            att.queue.put_nowait(SequenceOutput(request_id="rid", token_ids=[i], logprobs=[-0.5],
                                                finish_reason=reason, num_prompt_tokens=3 if i == 5 else 0,
                                                num_cached_tokens=16 if i == 5 else 0))
        step = await att.next()
        assert step.token_ids == [5, 6, 7] and step.logprobs == [-0.5] * 3
        assert step.finish_reason is FinishReason.LENGTH and att.cached_tokens == 16
        assert step.num_prompt_tokens == 3 and step.num_cached_tokens == 16
        assert att.first_seen

    asyncio.run(scenario())


def test_stats_timeouts_mark_a_worker_down_only_in_a_row() -> None:
    """A busy worker whose GetStats times out once keeps its requests; STATS_MISSES_DOWN
    timeouts in a row, or one UNAVAILABLE, mark it down and close its output stream."""
    from grpc import StatusCode
    from grpc.aio import AioRpcError, Metadata

    from pdserve.router.prefix_index import PrefixIndex
    from pdserve.router.settings import STATS_MISSES_DOWN
    from pdserve.router.worker_client import WorkerClient

    class FakeStub:
        def __init__(self) -> None:
            self.answers: list = []

        async def GetStats(self, request, timeout, wait_for_ready):
            answer = self.answers.pop(0)
            if isinstance(answer, StatusCode):
                raise AioRpcError(answer, Metadata(), Metadata(), details="test")
            return answer

    closed: list[str] = []

    async def scenario() -> None:
        client = WorkerClient("w:1", {Role.DECODE}, RouterSettings("r"), PrefixIndex(), lambda c, i: None)
        client._kv_unimplemented = True
        client.stub = stub = FakeStub()

        def bring_up() -> None:
            client.up = True
            client.subscription = SimpleNamespace(close=closed.append)

        bring_up()
        stub.answers = [StatusCode.DEADLINE_EXCEEDED] * (STATS_MISSES_DOWN - 1) + [worker_pb2.WorkerStats()]
        for _ in range(STATS_MISSES_DOWN):
            await client._poll_stats()
        assert client.up and not closed and client.stats_misses == 0 and client.stats is not None
        stub.answers = [StatusCode.DEADLINE_EXCEEDED] * STATS_MISSES_DOWN
        for _ in range(STATS_MISSES_DOWN - 1):
            await client._poll_stats()
        assert client.up and not closed
        await client._poll_stats()
        assert not client.up and closed and "in a row" in closed[0]
        bring_up()
        stub.answers = [StatusCode.UNAVAILABLE]
        await client._poll_stats()
        assert not client.up and len(closed) == 2
        await client.channel.close()

    asyncio.run(scenario())


def test_kv_events_only_for_workers_with_a_peer_of_their_kind() -> None:
    """The prefix index only ranks two or more candidates: a lone decode (or prefill) worker's
    KV events are not consumed; a second one of its pool turns them on for both, and losing it
    turns them off again (and forgets the index entries). A both worker is in both pools: it
    is also a place to prefill, beside the prefill worker (pdserve.router.pd_policy)."""
    async def scenario() -> None:
        reg = WorkerRegistry(RouterSettings("r"), SPEC, "p:1", "d:1,d:2")
        for address, roles in reg._targets:
            reg._add(address, roles)
        started: list[str] = []
        for c in reg.clients.values():
            c._task.cancel()                        # no supervisor: the test drives the states
            c._start_kv_events = lambda c=c: started.append(c.key) or setattr(
                c, "_kv_task", asyncio.ensure_future(asyncio.sleep(3600)))
        roles = {"p:1": Role.PREFILL, "d:1": Role.DECODE, "d:2": Role.BOTH}

        def up(key: str) -> None:
            c = reg.clients[key]
            c.info, c.up = WorkerInfo(role=roles[key]), True
            reg._changed()

        up("p:1")
        up("d:1")
        assert not any(c.kv_wanted for c in reg.clients.values()) and not started
        up("d:2")
        assert sorted(started) == ["d:1", "d:2", "p:1"] and reg.clients["p:1"].kv_wanted
        reg.prefix_index.apply("d:1", stored=[1, 2])
        reg.clients["d:2"].mark_down("test", quiet=True)
        assert not reg.clients["d:1"].kv_wanted and reg.clients["d:1"]._kv_task is None
        assert not reg.clients["p:1"].kv_wanted
        assert reg.prefix_index.num_blocks("d:1") == 0
        await reg.stop()

    asyncio.run(scenario())
