"""A whole decode worker in this process (servicer, engine thread, KV receiver and store, a real
grpc.aio server; the tiny model on the CPU): ten PushKV forged in the names of ten prefill workers
that never join their pair channel each end their reservation with an error, and leave the
process's thread count (``threading.active_count()``) where it was and the pool whole."""
from __future__ import annotations

import asyncio
import threading
import time
from contextlib import asynccontextmanager

import grpc.aio
import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.grpc_utils import Service, build_server, client_channel
from pdserve.common.grpc_utils.deferred import Deferred
from pdserve.common.kv_transfer import KvReceiver, KvStoreServer
from pdserve.common.serving.worker_runtime import WorkerRuntime
from pdserve.decode_worker.kv_import import KvImport
from pdserve.decode_worker.servicer import DecodeServicer
from pdserve.decode_worker.state import DecodeState
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

WORKER = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
ROUTER = "router-under-test"
KV_TIMEOUT_S = 1.0

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def decode_worker():
    """A decode worker as ``pdserve decode`` builds it, serving on a free port: (stub, receiver)."""
    store = KvStoreServer("127.0.0.1", 0)
    runtime = await WorkerRuntime.create("decode", "decode-under-test", EngineConfig(
        model="tiny-qwen3", device="cpu", num_kv_blocks=64, block_size=16))
    receiver = KvReceiver(runtime.engine.model_runner.kv_cache, runtime.worker_id, store, timeout=KV_TIMEOUT_S)
    kv_import = KvImport(runtime, DecodeState(runtime.outputs, 30_000, runtime.requests), receiver, store.address)
    runtime.start(kv_import.hooks)
    servicer = DecodeServicer(runtime, kv_import)
    gate = Deferred(WORKER, "loading")
    gate.bind(servicer)
    server = build_server("127.0.0.1:0", [Service(WORKER, worker_pb2_grpc.add_WorkerServicer_to_server, gate)])
    await server.start()
    try:
        async with client_channel(f"127.0.0.1:{server.port}") as channel:
            yield worker_pb2_grpc.WorkerStub(channel), receiver
    finally:
        await server.stop_now()
        servicer.close()
        store.close()


async def _finals(stream, want: int) -> list[worker_pb2.SequenceOutput]:
    finals: list[worker_pb2.SequenceOutput] = []
    async for msg in stream:
        finals += [o for o in msg.outputs if o.finish_reason]
        if len(finals) >= want:
            return finals
    return finals


async def _forge(stub, i: int) -> None:
    """Reserve a prompt, then announce its KV in the name of prefill worker ``forged-<i>``."""
    rid = f"forged-{i}"
    resp = await stub.Reserve(worker_pb2.ReserveRequest(
        request_id=rid, token_ids=list(range(10 + 40 * i, 47 + 40 * i)), router_id=ROUTER,
        params=common_pb2.SamplingParams(max_tokens=4)), timeout=10)
    await stub.PushKV(worker_pb2.PushKVRequest(
        request_id=rid, prefill_worker_id=rid, channel_epoch=1, num_blocks=len(resp.block_ids),
        block_ids=resp.block_ids, first_token_on_channel=True), timeout=10)


async def _until(cond, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.02)


async def _pool_whole(stub) -> None:
    """Until no block is used or reserved (the stats are the engine thread's, as of its last loop)."""
    for _ in range(100):
        stats = await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        if stats.num_used_blocks == 0 and stats.num_reserved == 0 and stats.num_free_blocks == stats.num_total_blocks:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks still held: {stats}")


def test_ten_forged_pushkv_leave_no_thread_and_a_whole_pool() -> None:
    async def main() -> None:
        async with decode_worker() as (stub, receiver):
            stream = stub.Subscribe(worker_pb2.SubscribeRequest(router_id=ROUTER))
            await stream.initial_metadata()
            await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
            baseline = threading.active_count()
            finals = asyncio.ensure_future(_finals(stream, 10))
            await asyncio.gather(*(_forge(stub, i) for i in range(10)))
            assert receiver.num_threads() == 10        # each waits for its sender, up to the timeout
            done = await asyncio.wait_for(finals, 10 * KV_TIMEOUT_S)
            assert sorted(o.request_id for o in done) == sorted(f"forged-{i}" for i in range(10))
            assert all(o.finish_reason == common_pb2.FINISH_REASON_ERROR and "did not join" in o.error
                       for o in done)
            await _until(lambda: threading.active_count() == baseline,
                         f"threads back to {baseline} (now {threading.active_count()})")
            assert receiver.num_threads() == 0 and receiver.num_open_channels() == 0
            await _pool_whole(stub)
            stream.cancel()

    asyncio.run(asyncio.wait_for(main(), timeout=50))


def test_a_forged_pushkv_with_a_bad_field_frees_its_reservation_at_once() -> None:
    async def main() -> None:
        async with decode_worker() as (stub, receiver):
            stream = stub.Subscribe(worker_pb2.SubscribeRequest(router_id=ROUTER))
            await stream.initial_metadata()
            resp = await stub.Reserve(worker_pb2.ReserveRequest(
                request_id="r", token_ids=list(range(3, 40)), router_id=ROUTER), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.PushKV(worker_pb2.PushKVRequest(
                    request_id="r", prefill_worker_id="p", channel_epoch=1, num_blocks=3,
                    block_ids=resp.block_ids, first_token_id=1 << 20), timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "first_token_id" in (e.value.details() or "")
            [out] = await asyncio.wait_for(_finals(stream, 1), 10)
            assert out.request_id == "r" and out.finish_reason == common_pb2.FINISH_REASON_ERROR
            await _pool_whole(stub)
            assert receiver.num_peers() == 0           # nothing was posted: no record, no thread
            stream.cancel()

    asyncio.run(asyncio.wait_for(main(), timeout=50))
