"""A decode worker (its own process, CPU, Gloo) whose KV receive fails: the first PushKV of an
epoch fails on the receive thread, the next PushKV of that (now broken) epoch fails at once in
the handler (FAILED_PRECONDITION). Either way the reservation ends and the pool is whole."""
from __future__ import annotations

import sys
import threading
import time

import grpc
import pytest

from pdserve.loadtest.ports import free_port
from pdserve.loadtest.procs import Service, wait_ready
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

ROUTER = "router-under-test"
PROMPT = list(range(3, 40))   # 37 tokens: 3 blocks of 16


@pytest.fixture(scope="module")
def decode(tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "decode", "--host", "127.0.0.1", "--port", str(port),
           "--kv-port", str(free_port()), "--metrics-port", "0", "--model", "default", "--device", "cpu",
           "--num-kv-blocks", "32", "--kv-timeout-s", "5"]
    log = tmp_path_factory.mktemp("logs") / "decode.log"
    svc = Service("decode", cmd, f"127.0.0.1:{port}", log, {"PDSERVE_LOG_LEVEL": "INFO"}).start()
    try:
        wait_ready([svc], 240)
        with grpc.insecure_channel(svc.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            stream = stub.Subscribe(worker_pb2.SubscribeRequest(router_id=ROUTER))
            finished: list[worker_pb2.SequenceOutput] = []
            reader = threading.Thread(target=_read, args=(stream, finished), daemon=True)
            reader.start()
            stream.initial_metadata()          # the stream is open: Reserve may name this router
            yield stub, finished
            stream.cancel()
    finally:
        svc.stop()


def _read(stream, finished: list) -> None:
    try:
        for msg in stream:
            finished.extend(o for o in msg.outputs if o.finish_reason)
    except grpc.RpcError:
        pass


def _reserve(stub, request_id: str) -> list[int]:
    resp = stub.Reserve(worker_pb2.ReserveRequest(
        request_id=request_id, token_ids=PROMPT, router_id=ROUTER,
        params=common_pb2.SamplingParams(temperature=0, max_tokens=4)), timeout=30)
    assert len(resp.block_ids) == 3 and resp.num_cached_tokens == 0
    return list(resp.block_ids)


def _push(stub, request_id: str, block_ids: list[int], epoch: int, secret: str) -> None:
    stub.PushKV(worker_pb2.PushKVRequest(
        request_id=request_id, prefill_worker_id="prefill-gone", channel_epoch=epoch, first_token_id=5,
        num_blocks=len(block_ids), block_ids=block_ids, pair_secret=secret), timeout=30)


def _wait_whole(stub, tries: int = 100) -> worker_pb2.WorkerStats:
    for _ in range(tries):
        s = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        if s.num_used_blocks == 0 and s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0 \
                and s.num_running == 0 and s.num_waiting == 0:
            return s
        time.sleep(0.1)
    raise AssertionError(f"the decode worker did not release its blocks: {s}")


def _finished(finished: list, request_id: str, tries: int = 100):
    for _ in range(tries):
        hit = [o for o in finished if o.request_id == request_id]
        if hit:
            return hit[0]
        time.sleep(0.1)
    raise AssertionError(f"no final output for {request_id}")


def test_failed_receive_then_refused_pushkv_leave_the_pool_whole(decode):
    stub, finished = decode
    # A malformed pair secret fails on the receive thread: the reservation ends with an error
    # and the epoch is marked broken on this worker.
    _push(stub, "r1", _reserve(stub, "r1"), epoch=7, secret="not-a-secret")
    assert _finished(finished, "r1").finish_reason == common_pb2.FINISH_REASON_ERROR
    _wait_whole(stub)

    # The broken epoch is refused inside PushKV itself (nothing was posted).
    blocks = _reserve(stub, "r2")
    with pytest.raises(grpc.RpcError) as e:
        _push(stub, "r2", blocks, epoch=7, secret="")
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "broken" in e.value.details()
    out = _finished(finished, "r2")
    assert out.finish_reason == common_pb2.FINISH_REASON_ERROR and "KV transfer failed" in out.error
    _wait_whole(stub)
