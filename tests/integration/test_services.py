"""Router + prefill worker + decode worker as separate processes, embedded model, CPU, Gloo.

Greedy outputs must equal the offline engine's token for token, under concurrency, shared
prefixes and preemption on the decode worker; cancellation and deadlines leave both block pools
whole; a dead worker gives UNAVAILABLE quickly.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from bench import deployment as services
from pdserve.common.engine import SamplingParams
from pdserve.v1 import common_pb2, router_pb2, worker_pb2, worker_pb2_grpc

MAX_TOKENS = 20
SYSTEM = ("You are a meticulous assistant for a railway company. Answer briefly and precisely, "
          "quote timetables exactly, never invent stations, and when unsure say so. ") * 3
QUESTIONS = ["When does the first train leave?", "Is there a dining car?", "Can I bring a bicycle?",
             "How long is the trip to the coast?", "Are pets allowed?", "What is a season ticket?",
             "Where is platform nine?", "Do trains run on holidays?", "How do I get a refund?",
             "Is there wifi on board?", "Can I reserve a seat?", "What about night trains?"]
OTHERS = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?",
          "Who wrote Hamlet?", "Translate 'cat' into French.", "What is the boiling point of water?"]


@pytest.fixture(scope="module")
def prompts(offline):
    shared = [offline.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
              for q in QUESTIONS]
    plain = [offline.apply_chat_template([{"role": "user", "content": q}]) for q in OTHERS]
    return shared + plain


@pytest.fixture(scope="module")
def expected(offline, prompts):
    outs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    # 48 blocks of 16 tokens on the decode worker: a few requests fill it, so it preempts
    dep = services.start(tmp_path_factory.mktemp("logs"), decode_blocks=48)
    yield dep
    dep.stop()


def _request(tokens: list[int], max_tokens: int = MAX_TOKENS) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens),
                                      params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def _stream(dep, tokens: list[int]) -> tuple[list[int], router_pb2.GenerateResponse, int]:
    return _stream_max(dep, tokens, MAX_TOKENS)


def _stream_max(dep, tokens: list[int], max_tokens: int) -> tuple[list[int], router_pb2.GenerateResponse, int]:
    stub = dep.router_stub()
    ids, last, messages = [], None, 0
    for msg in stub.Generate(_request(tokens, max_tokens), timeout=180):
        ids.extend(msg.token_ids)
        last, messages = msg, messages + 1
    return ids, last, messages


def test_concurrent_streams_match_offline(deployment, prompts, expected):
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: _stream(deployment, p), prompts))
    for (ids, last, _), want in zip(results, expected):
        assert ids == want
        assert last.finish_reason in (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
        assert last.usage.completion_tokens == len(want)
    decode = deployment.stats(deployment.decode[0])
    prefill = deployment.stats(deployment.prefill[0])
    assert prefill.num_kv_transfers > 0 and decode.num_kv_transfers > 0        # KV crossed the pair channel
    assert decode.kv_transfer_bytes == prefill.kv_transfer_bytes
    assert decode.num_preemptions > 0                                          # the small pool preempted
    assert prefill.prefix_cache_hit_tokens > 0                                 # the shared system prompt
    deployment.wait_whole(deployment.decode[0])
    deployment.wait_whole(deployment.prefill[0])


def test_cancel_mid_stream_frees_blocks(deployment, prompts):
    call = deployment.router_stub().Generate(_request(prompts[0], max_tokens=400), timeout=120)
    got = 0
    for msg in call:
        got += len(msg.token_ids)
        if got >= 3:
            call.cancel()
            break
    deployment.wait_whole(deployment.decode[0])
    deployment.wait_whole(deployment.prefill[0])


def test_deadline_frees_blocks(deployment, prompts):
    with pytest.raises(grpc.RpcError) as e:
        for _ in deployment.router_stub().Generate(_request(prompts[1], max_tokens=400), timeout=1.5):
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deployment.wait_whole(deployment.decode[0])
    deployment.wait_whole(deployment.prefill[0])


def test_first_token_that_ends_the_request_frees_both_pools(deployment, prompts, expected):
    """max_tokens 1: the prefill worker's token ends the request while its KV is already on
    its way (the send starts at the step's launch); both pools end whole."""
    ids, last, _ = _stream_max(deployment, prompts[3], 1)
    assert ids == expected[3][:1] and last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    deployment.wait_whole(deployment.decode[0])
    deployment.wait_whole(deployment.prefill[0])


def test_prefill_refuses_a_kv_target_with_nothing_to_ship(deployment, prompts):
    """A decode worker's cached prefix never covers the last prompt token: a KvTarget that says
    so is INVALID_ARGUMENT, named, and nothing is left allocated."""
    tokens = prompts[4]
    blocks = -(-len(tokens) // 16)
    target = worker_pb2.KvTarget(decode_worker_id="d", kv_store_address="127.0.0.1:1",
                                 decode_address="127.0.0.1:1", block_ids=list(range(blocks)),
                                 num_cached_tokens=blocks * 16)
    with grpc.insecure_channel(deployment.prefill[0]) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Prefill(worker_pb2.PrefillRequest(request_id="bad-target", token_ids=tokens,
                                                        kv_target=target), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_target.num_cached_tokens" in e.value.details()
    deployment.wait_whole(deployment.prefill[0])


def test_bad_input_is_invalid_argument(deployment):
    stub = deployment.router_stub()
    bad = router_pb2.GenerateRequest(text="hello", params=common_pb2.SamplingParams(top_p=2.0, max_tokens=4))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
    too_long = router_pb2.GenerateRequest(text="hi " * 20000, params=common_pb2.SamplingParams(max_tokens=4))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(too_long, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_dead_decode_worker_gives_unavailable_quickly(deployment, prompts):
    deployment.kill("decode0")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(deployment.router_stub().Generate(_request(prompts[2]), timeout=30))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - start < 5
