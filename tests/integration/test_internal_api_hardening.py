"""The internal API trusts nothing it receives (real processes on the CPU: a decode and a prefill
worker of the tiny model; this test plays the router and a forging prefill worker, whose KV
crosses a real Gloo pair channel).

A first token outside the vocabulary, in the PushKV call or at the end of the transfer, is
refused before the sequence joins the batch, while another stream on the same decode worker runs
to its end; bad fields are INVALID_ARGUMENT naming the field and free the request's blocks; an
rpc of another role is FAILED_PRECONDITION, as worker.proto documents."""
from __future__ import annotations

import sys
import threading
import time

import grpc
import pytest
import torch

from pdserve.common.kv_transfer import FirstTokenRef, KvSender
from pdserve.common.loader import resolve_model
from pdserve.loadtest.ports import free_port
from pdserve.loadtest.procs import Service, stop_together, wait_ready
from pdserve.v1 import common_pb2, common_pb2_grpc, worker_pb2, worker_pb2_grpc

ROUTER = "router-under-test"
MODEL = "tiny-qwen3"
PROMPT = list(range(3, 40))   # 37 tokens: 3 blocks of 16


def _prompt(request_id: str) -> list[int]:
    """A 37-token prompt of its own per request (no prefix-cache hit between requests)."""
    first = 3 + sum(request_id.encode()) * 7 % 400
    return list(range(first, first + 37))
LONG = 900                    # tokens of the stream that must run through it all (~1-3 s on a CPU)

pytestmark = pytest.mark.timeout(300)


class Outputs:
    """Everything the decode worker streams to ROUTER, by request."""

    def __init__(self) -> None:
        self.by_request: dict[str, list[worker_pb2.SequenceOutput]] = {}
        self.lock = threading.Lock()

    def read(self, stream) -> None:
        try:
            for msg in stream:
                with self.lock:
                    for o in msg.outputs:
                        self.by_request.setdefault(o.request_id, []).append(o)
        except grpc.RpcError:
            pass

    def of(self, request_id: str) -> list[worker_pb2.SequenceOutput]:
        with self.lock:
            return list(self.by_request.get(request_id, ()))

    def final(self, request_id: str, timeout: float = 20.0) -> worker_pb2.SequenceOutput:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            done = [o for o in self.of(request_id) if o.finish_reason]
            if done:
                return done[0]
            time.sleep(0.02)
        raise AssertionError(f"no final output for {request_id}")

    def tokens(self, request_id: str) -> list[int]:
        return [t for o in self.of(request_id) for t in o.token_ids]


def _worker(kind: str, log_dir, extra: list[str]) -> Service:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", kind, "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--model", MODEL, "--device", "cpu", *extra]
    return Service(kind, cmd, f"127.0.0.1:{port}", log_dir / f"{kind}.log", {"PDSERVE_LOG_LEVEL": "INFO"})


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    decode = _worker("decode", logs, ["--kv-port", str(free_port()), "--num-kv-blocks", "64", "--kv-timeout-s", "5"])
    prefill = _worker("prefill", logs, ["--num-kv-blocks", "16"])
    services = [decode.start(), prefill.start()]
    try:
        wait_ready(services, 240)
        with grpc.insecure_channel(decode.address) as dch, grpc.insecure_channel(prefill.address) as pch:
            stub = worker_pb2_grpc.WorkerStub(dch)
            info = common_pb2_grpc.InfoServiceStub(dch).Info(common_pb2.InfoRequest(), timeout=10)
            stream = stub.Subscribe(worker_pb2.SubscribeRequest(router_id=ROUTER))
            outputs = Outputs()
            threading.Thread(target=outputs.read, args=(stream,), daemon=True).start()
            stream.initial_metadata()          # the stream is open: Reserve may name this router
            yield stub, worker_pb2_grpc.WorkerStub(pch), info, outputs
            stream.cancel()
    finally:
        stop_together(services)


def _params(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _reserve(stub, request_id: str, max_tokens: int = 4) -> worker_pb2.ReserveResponse:
    resp = stub.Reserve(worker_pb2.ReserveRequest(request_id=request_id, token_ids=_prompt(request_id),
                                                  router_id=ROUTER, params=_params(max_tokens)), timeout=30)
    assert len(resp.block_ids) == 3 and resp.num_cached_tokens == 0
    return resp


def _refused(call, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT) -> str:
    """``call()`` fails with ``code``; its details."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    assert e.value.code() == code, e.value.details()
    return e.value.details()


def _wait_whole(stub, tries: int = 100) -> None:
    for _ in range(tries):
        s = stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
        if s.num_used_blocks == 0 and s.num_free_blocks == s.num_total_blocks and s.num_reserved == 0 \
                and s.num_running == 0 and s.num_waiting == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"the decode worker did not release its blocks: {s}")


def _source_pool(info) -> torch.Tensor:
    """A pool of the decode worker's block geometry, for the forging sender."""
    cfg = resolve_model(MODEL).config
    assert info.dtype == "float32"
    return torch.randn(4, cfg.num_hidden_layers, 2, info.block_size, cfg.num_key_value_heads, cfg.head_dim)


def test_out_of_vocabulary_first_token_is_refused_and_another_stream_completes(workers):
    stub, _, info, outputs = workers
    vocab = info.vocab_size
    stub.Submit(worker_pb2.SubmitRequest(request_id="long", token_ids=PROMPT, router_id=ROUTER,
                                         params=_params(LONG)), timeout=30)
    end = time.monotonic() + 20
    while not outputs.of("long") and time.monotonic() < end:
        time.sleep(0.01)
    assert outputs.of("long"), "the long stream did not start"

    # 1. in the PushKV call: refused at once, naming the field; the reservation ends
    blocks = list(_reserve(stub, "bad-call").block_ids)
    details = _refused(lambda: stub.PushKV(worker_pb2.PushKVRequest(
        request_id="bad-call", prefill_worker_id="forger", channel_epoch=1, first_token_id=vocab + 7,
        num_blocks=3, block_ids=blocks), timeout=30))
    assert "first_token_id" in details
    out = outputs.final("bad-call")
    assert out.finish_reason == common_pb2.FINISH_REASON_ERROR and "first_token_id" in out.error

    # 2. at the end of the transfer's last message: the blocks cross, the token is refused on arrival
    src = _source_pool(info)
    sender = KvSender("forger", timeout=5, pair_secrets=True)
    try:
        resp = _reserve(stub, "bad-channel")
        target = resp.worker_id
        for request_id, token, max_tokens in (("bad-channel", vocab + 7, 4), ("good-channel", 5, 4)):
            if request_id != "bad-channel":
                resp = _reserve(stub, request_id, max_tokens)
            with sender.lock(target):
                epoch = sender.next_epoch(target)
                stub.PushKV(worker_pb2.PushKVRequest(
                    request_id=request_id, prefill_worker_id="forger", channel_epoch=epoch, num_blocks=3,
                    block_ids=resp.block_ids, num_bytes=3 * src[0].numel() * src.element_size(),
                    first_token_on_channel=True, pair_secret=sender.pair_secret(target)), timeout=30)
                sender.send_blocks(target, resp.kv_store_address, epoch, src, [0, 1, 2],
                                   first_token=FirstTokenRef(torch.tensor([token]), None, 0))
            if request_id == "bad-channel":
                out = outputs.final("bad-channel")
                assert out.finish_reason == common_pb2.FINISH_REASON_ERROR
                assert "outside the vocabulary" in out.error and not out.token_ids
                assert not [o for o in outputs.of("long") if o.finish_reason], "the long stream ended early"
        # the channel is still good: a well-formed transfer on it decodes to its end
        assert outputs.final("good-channel").finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(outputs.tokens("good-channel")) == 3     # the first token is not repeated
    finally:
        sender.close()

    # the other stream ran on through all of it
    out = outputs.final("long", timeout=60)
    assert out.finish_reason == common_pb2.FINISH_REASON_LENGTH and not out.error
    assert len(outputs.tokens("long")) == LONG
    _wait_whole(stub)


def test_bad_fields_are_invalid_argument_naming_the_field_and_free_the_blocks(workers):
    stub, prefill, info, outputs = workers
    vocab, max_len = info.vocab_size, info.max_model_len

    def reserve(request_id="bad", token_ids=PROMPT, **kw):
        return lambda: stub.Reserve(worker_pb2.ReserveRequest(request_id=request_id, token_ids=token_ids,
                                                              router_id=ROUTER, **kw), timeout=30)

    assert "token_ids[1]" in _refused(reserve(token_ids=[3, vocab, 4]))
    assert "token_ids" in _refused(reserve(token_ids=[3] * max_len))
    assert "params.stop_token_ids[0]" in _refused(reserve(params=common_pb2.SamplingParams(stop_token_ids=[vocab])))
    assert "lease_ms" in _refused(reserve(lease_ms=2**32 - 1))
    assert "token_ids[0]" in _refused(lambda: stub.Submit(worker_pb2.SubmitRequest(
        request_id="bad", token_ids=[vocab + 1], router_id=ROUTER), timeout=30))

    def push(request_id: str, reserved: list[int], **bad):
        fields = dict(request_id=request_id, prefill_worker_id="forger", channel_epoch=1,
                      num_blocks=len(reserved), block_ids=reserved, first_token_id=5)
        fields.update(bad)
        return lambda: stub.PushKV(worker_pb2.PushKVRequest(**fields), timeout=30)

    # each refused PushKV ends its reservation at once: its blocks are free without waiting for the lease
    for request_id, field, bad in (("bad-ids", "block_ids", {"block_ids": [0, 1, 10_000], "num_blocks": 3}),
                                   ("bad-count", "num_blocks", {"num_blocks": 7}),
                                   ("bad-peer", "prefill_worker_id", {"prefill_worker_id": "a/b"}),
                                   ("bad-bytes", "num_bytes", {"num_bytes": 1})):
        blocks = list(_reserve(stub, request_id).block_ids)
        assert field in _refused(push(request_id, blocks, **bad))
        out = outputs.final(request_id)
        assert out.finish_reason == common_pb2.FINISH_REASON_ERROR and field in out.error
    # block ids of the pool that are not the reservation's: FAILED_PRECONDITION (worker.proto)
    blocks = list(_reserve(stub, "other-ids").block_ids)
    wrong = [b for b in range(info.num_kv_blocks) if b not in blocks][:3]
    _refused(push("other-ids", wrong), grpc.StatusCode.FAILED_PRECONDITION)
    assert outputs.final("other-ids").finish_reason == common_pb2.FINISH_REASON_ERROR
    _wait_whole(stub)

    def prefill_call(token_ids=PROMPT, decode_worker_id="decode-0", kv_store_address="127.0.0.1:1"):
        target = worker_pb2.KvTarget(decode_worker_id=decode_worker_id, kv_store_address=kv_store_address,
                                     decode_address="127.0.0.1:1", block_ids=[0, 1, 2])
        return lambda: list(prefill.Prefill(worker_pb2.PrefillRequest(
            request_id="p-bad", token_ids=token_ids, kv_target=target), timeout=30))

    assert "token_ids[36]" in _refused(prefill_call(token_ids=[*PROMPT[:-1], vocab]))
    assert "kv_target.decode_worker_id" in _refused(prefill_call(decode_worker_id="a/b"))
    assert "kv_target.kv_store_address" in _refused(prefill_call(kv_store_address="nowhere"))
    stats = prefill.GetStats(worker_pb2.GetStatsRequest(), timeout=10)
    assert stats.num_used_blocks == 0 and stats.num_waiting == 0


def test_rpcs_of_another_role_are_failed_precondition(workers):
    decode, prefill, _, _ = workers
    failed = grpc.StatusCode.FAILED_PRECONDITION
    calls = {
        "Reserve": lambda: prefill.Reserve(worker_pb2.ReserveRequest(
            request_id="r", token_ids=PROMPT, router_id=ROUTER), timeout=10),
        "PushKV": lambda: prefill.PushKV(worker_pb2.PushKVRequest(request_id="r"), timeout=10),
        "Submit": lambda: prefill.Submit(worker_pb2.SubmitRequest(
            request_id="r", token_ids=PROMPT, router_id=ROUTER), timeout=10),
        "Subscribe": lambda: list(prefill.Subscribe(worker_pb2.SubscribeRequest(router_id=ROUTER), timeout=10)),
        "Prefill": lambda: list(decode.Prefill(worker_pb2.PrefillRequest(request_id="r", token_ids=PROMPT),
                                               timeout=10)),
    }
    for rpc, call in calls.items():
        details = _refused(call, failed)
        assert f"{rpc} is not served by a worker of role" in details, details
    # the rpcs of every role answer on both
    for stub in (decode, prefill):
        assert not stub.Cancel(worker_pb2.CancelRequest(request_id="nobody"), timeout=10).found
        assert stub.GetStats(worker_pb2.GetStatsRequest(), timeout=10).num_total_blocks > 0
