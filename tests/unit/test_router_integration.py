"""The router over real gRPC, with scripted workers (pdserve/loadtest/scripted_worker.py), all as separate
processes on free local ports.

Deployments (started once for the module, concurrently):
- ``disagg``: router (embedded default model's tokenizer) + scripted prefill + scripted decode;
- ``both``: router (tokenizer-less preset tiny-llama) + one scripted worker of role both, listed
  as ``dns:///localhost:PORT`` (DNS discovery);
- ``failover``: router (tiny-llama) + a both worker that fails every Submit with UNAVAILABLE and
  a healthy one (killed during the tests).

Outputs are checked against the script (``script_token``); cancellation and deadlines are
checked on the workers' own GetStats (polled a bounded number of times).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from router_cluster import (
    FR,
    ROOT,
    SP,
    TINY_VOCAB,
    VOCAB,
    Deployment,
    expected,
    idle,
    ids_request,
    poll,
    router,
    wait_serving,
    worker,
)

from pdserve.loadtest.ports import free_port
from pdserve.loadtest.scripted_state import script_logprob
from pdserve.v1 import common_pb2, common_pb2_grpc, router_pb2


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from pdserve.router.tokenization import resolve_spec
    resolve_spec("default")   # import the embedded model once, before the routers race for it
    tmp = tmp_path_factory.mktemp("router")
    tiny = ("--model", "tiny-llama", "--vocab", str(TINY_VOCAB), "--max-model-len", "1024")
    w = {
        "prefill": worker(tmp, "prefill", "prefill", "--prefill-ms", "150"),
        "decode": worker(tmp, "decode", "decode"),
        "both": worker(tmp, "both", "both", *tiny),
        "faulty": worker(tmp, "faulty", "both", "--fail-submits", "-1", *tiny),
        "healthy": worker(tmp, "healthy", "both", *tiny),
    }
    metrics = free_port()
    deps = {
        "disagg": Deployment(router(tmp, "r-disagg", "default", w["prefill"].address, w["decode"].address,
                                    metrics_port=metrics), {k: w[k] for k in ("prefill", "decode")}, metrics),
        "both": Deployment(router(tmp, "r-both", "tiny-llama", "", f"dns:///localhost:{w['both'].port}"),
                           {"both": w["both"]}),
    }
    failover_metrics = free_port()
    deps["failover"] = Deployment(
        router(tmp, "r-failover", "tiny-llama", "", f"{w['faulty'].address},{w['healthy'].address}",
               metrics_port=failover_metrics), {k: w[k] for k in ("faulty", "healthy")}, failover_metrics)
    everything = list(w.values()) + [d.router for d in deps.values()]
    try:
        for p in w.values():
            p.start()
        wait_serving(list(w.values()))
        for d in deps.values():
            d.router.start()
        wait_serving([d.router for d in deps.values()])
        yield deps
    finally:
        for p in everything:      # SIGTERM all, then wait for each
            p.send(signal.SIGTERM)
        for p in everything:
            p.stop(None)
    for d in deps.values():   # no unexpected error or stray traceback in any router's log
        log = d.router.log.read_text(errors="replace")
        assert "Traceback" not in log and " ERROR " not in log, d.router.tail(60)


# ---- generation ---------------------------------------------------------------------------
def test_disaggregated_stream_tokens_usage_logprobs(cluster) -> None:
    dep = cluster["disagg"]
    prompt = list(range(100, 140))
    msgs = list(dep.stub().Generate(ids_request(prompt, max_tokens=12, logprobs=True), timeout=20))
    tokens = [t for m in msgs for t in m.token_ids]
    assert tokens == expected(prompt, 12)
    assert [lp for m in msgs for lp in m.logprobs] == pytest.approx([script_logprob(i) for i in range(12)])
    assert msgs[0].token_ids == [tokens[0]]                      # the prefill's first token, alone
    assert all(m.finish_reason == FR.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    last = msgs[-1]
    assert last.finish_reason == FR.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 12)
    assert all(m.request_id == msgs[0].request_id and m.request_id for m in msgs)
    from pdserve.router.tokenization import RouterTokenizer, resolve_spec
    hf = RouterTokenizer(resolve_spec("default").tokenizer_dir).hf
    assert "".join(m.text for m in msgs) == hf.decode(tokens, skip_special_tokens=True)
    poll(idle(dep, "decode"), "decode worker idle")
    stats = dep.stats("decode")
    assert stats.num_cached_blocks >= 2 and stats.prefix_cache_query_tokens >= 40


def test_chat_text_and_unary(cluster) -> None:
    dep = cluster["disagg"]
    stub = dep.stub()
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content="What is 2+2?")])
    tok = stub.Tokenize(router_pb2.TokenizeRequest(chat=chat))
    assert tok.count == len(tok.token_ids) > 5 and "<|im_start|>user" in tok.rendered_prompt
    assert tok.rendered_prompt.endswith("<|im_start|>assistant\n")
    result = stub.GenerateUnary(router_pb2.GenerateRequest(request_id="mine-1", chat=chat,
                                                           params=SP(max_tokens=6)), timeout=20)
    assert result.request_id == "mine-1"
    assert list(result.token_ids) == expected(list(tok.token_ids), 6)
    assert result.finish_reason == FR.FINISH_REASON_LENGTH and result.text
    text_tok = stub.Tokenize(router_pb2.TokenizeRequest(text="Hello world"))
    streamed = list(stub.Generate(router_pb2.GenerateRequest(text="Hello world", params=SP(max_tokens=5)), timeout=20))
    assert [t for m in streamed for t in m.token_ids] == expected(list(text_tok.token_ids), 5)


def test_stop_string_truncates_and_cancels(cluster) -> None:
    dep = cluster["disagg"]
    stub = dep.stub()
    prompt = list(range(200, 230))
    full = stub.GenerateUnary(ids_request(prompt, max_tokens=30), timeout=20).text
    stop = full[len(full) // 2: len(full) // 2 + 4]
    cut = full[:full.index(stop)]
    msgs = list(stub.Generate(ids_request(prompt, max_tokens=3000, stop=[stop]), timeout=20))
    assert "".join(m.text for m in msgs) == cut
    assert msgs[-1].finish_reason == FR.FINISH_REASON_STOP_STRING and msgs[-1].matched_stop == stop
    assert msgs[-1].usage.completion_tokens < 30
    kept = stub.GenerateUnary(ids_request(prompt, max_tokens=3000, stop=[stop]), timeout=20)
    assert kept.text == cut
    incl = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=prompt), include_stop_str_in_output=True,
                                      params=SP(max_tokens=3000, stop=[stop]))
    assert stub.GenerateUnary(incl, timeout=20).text == cut + stop
    poll(idle(dep, "decode"), "decode worker cancelled the stopped requests")   # max_tokens=3000 otherwise


def test_stop_token_and_first_token_finish(cluster) -> None:
    dep = cluster["disagg"]
    stub = dep.stub()
    prompt = list(range(300, 320))
    want = expected(prompt, 4)
    r = stub.GenerateUnary(ids_request(prompt, max_tokens=50, stop_token_ids=[want[3]]), timeout=20)
    assert list(r.token_ids) == want and r.finish_reason == FR.FINISH_REASON_STOP
    one = stub.GenerateUnary(ids_request(prompt, max_tokens=1), timeout=20)   # the prefill ends it
    assert list(one.token_ids) == want[:1] and one.finish_reason == FR.FINISH_REASON_LENGTH
    poll(idle(dep, "decode"), "the reservation of the max_tokens=1 request is cancelled")


def test_both_flow_and_prefix_cache(cluster) -> None:
    dep = cluster["both"]
    stub = dep.stub()
    prompt = list(range(1, 41))       # 2 full blocks of 16 + 8
    msgs = list(stub.Generate(ids_request(prompt, max_tokens=10, logprobs=True), timeout=20))
    assert [t for m in msgs for t in m.token_ids] == expected(prompt, 10, TINY_VOCAB)
    assert msgs[-1].finish_reason == FR.FINISH_REASON_LENGTH
    assert msgs[-1].usage.completion_tokens == 10 and msgs[-1].usage.prompt_tokens == 40
    again = list(stub.Generate(ids_request(prompt, max_tokens=3), timeout=20))
    assert again[-1].usage.cached_tokens == 32
    info = stub.GetModelInfo(router_pb2.GetModelInfoRequest())
    assert (info.model, info.vocab_size, info.max_model_len, info.has_chat_template) == ("tiny-llama", 512, 1024, False)
    assert info.num_decode_workers == 1 and info.num_prefill_workers == 1


# ---- validation -----------------------------------------------------------------------------
BAD = [
    (router_pb2.GenerateRequest(text=""), "text"),
    (router_pb2.GenerateRequest(), "input"),
    (router_pb2.GenerateRequest(text="hi", params=SP(top_p=2.0)), "top_p"),
    (router_pb2.GenerateRequest(text="hi", params=SP(temperature=-1)), "temperature"),
    (router_pb2.GenerateRequest(text="hi", params=SP(max_tokens=9000)), "max_tokens"),
    (router_pb2.GenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="wizard", content="x")])),
     "role"),
    (router_pb2.GenerateRequest(chat=router_pb2.ChatMessages()), "chat.messages"),
    (ids_request([1, VOCAB + 5]), "token_ids.ids[1]"),
    (router_pb2.GenerateRequest(text="hi", params=SP(stop_token_ids=[VOCAB])), "stop_token_ids"),
]


@pytest.mark.parametrize("request_,field_name", BAD, ids=[f for _, f in BAD])
def test_invalid_argument_names_the_field(cluster, request_, field_name) -> None:
    stub = cluster["disagg"].stub()
    for call in (lambda: list(stub.Generate(request_, timeout=10)), lambda: stub.GenerateUnary(request_, timeout=10)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field_name in e.value.details()


def test_text_input_without_tokenizer(cluster) -> None:
    stub = cluster["both"].stub()
    for call in (lambda: list(stub.Generate(router_pb2.GenerateRequest(text="hello"), timeout=10)),
                 lambda: stub.Tokenize(router_pb2.TokenizeRequest(text="hello"), timeout=10)):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "text" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(ids_request([i % 500 for i in range(1000)], max_tokens=100), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()


# ---- cancellation and deadlines -------------------------------------------------------------
def test_client_cancel_during_decode_frees_blocks(cluster) -> None:
    for name, workers in (("disagg", ("decode", "prefill")), ("both", ("both",))):
        dep = cluster[name]
        call = dep.stub().Generate(ids_request(list(range(400, 450)), max_tokens=900), timeout=30)
        next(call), next(call), next(call)
        busy = dep.stats(workers[0])
        assert busy.num_running == 1 and busy.num_used_blocks >= 4
        call.cancel()
        for w in workers:
            poll(idle(dep, w), f"{name}/{w} freed the cancelled request")


def test_client_cancel_during_prefill(cluster) -> None:
    dep = cluster["disagg"]
    call = dep.stub().Generate(ids_request(list(range(500, 540)), max_tokens=900), timeout=30)
    poll(lambda: dep.stats("prefill").num_running == 1, "prefill started", attempts=100, interval=0.005)
    call.cancel()
    for w in ("prefill", "decode"):
        poll(idle(dep, w), f"{w} freed the request cancelled in prefill")


def test_deadline_exceeded_frees_blocks(cluster) -> None:
    for name, workers in (("disagg", ("decode", "prefill")), ("both", ("both",))):
        dep = cluster[name]
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            list(dep.stub().Generate(ids_request(list(range(50, 90)), max_tokens=900), timeout=0.4))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 2.0
        for w in workers:
            poll(idle(dep, w), f"{name}/{w} freed the expired request")


# ---- info, metrics --------------------------------------------------------------------------
def test_model_info_router_info_metrics(cluster) -> None:
    dep = cluster["disagg"]
    info = dep.stub().GetModelInfo(router_pb2.GetModelInfoRequest())
    assert info.model == "SmolLM2-135M-Instruct" and info.vocab_size == VOCAB and info.block_size == 16
    assert info.max_model_len == 8192 and info.has_chat_template and list(info.eos_token_ids) == [2]
    assert (info.num_prefill_workers, info.num_decode_workers) == (1, 1)
    with grpc.insecure_channel(dep.router.address) as ch:
        server = common_pb2_grpc.InfoServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=5)
    assert server.role == common_pb2.ROLE_ROUTER and server.worker_id == "r-disagg" and server.protocol_version == "v1"
    body = urllib.request.urlopen(f"http://127.0.0.1:{dep.metrics_port}/metrics", timeout=5).read().decode()
    assert 'pdserve_router_requests_total{method="Generate",status="OK"}' in body
    assert "pdserve_router_ttft_seconds_bucket" in body and "pdserve_router_output_tokens_total" in body


# ---- failures ---------------------------------------------------------------------------------
def _metric(dep: Deployment, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{dep.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name))


def test_failover_retry_then_worker_down(cluster) -> None:
    dep = cluster["failover"]
    stub = dep.stub()
    for k in range(6):   # short distinct prompts (no cached prefix): placement alternates, and
        prompt = [k + 1] * 10   # those that land on the faulty worker are retried on the healthy one
        r = stub.GenerateUnary(ids_request(prompt, max_tokens=4), timeout=10)
        assert list(r.token_ids) == expected(prompt, 4, TINY_VOCAB)
    prompt = list(range(10, 30))
    assert _metric(dep, "pdserve_router_retries_total") >= 1, dep.router.tail()

    call = stub.Generate(ids_request(prompt, max_tokens=900), timeout=30)
    next(call)
    dep.workers["healthy"].stop(signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(call)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2.0

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.GenerateUnary(ids_request(prompt, max_tokens=4), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 2.0


# ---- the Python client --------------------------------------------------------------------------
def test_python_client(cluster) -> None:
    from pdserve.client import generate, stream_generate
    from pdserve.common.grpc_utils import InvalidArgument
    from pdserve.common.sampling_params import SamplingParams

    address = cluster["disagg"].router.address
    params = SamplingParams(temperature=0.0, max_tokens=6)
    out = generate(address, "Hello there", params, chat=True)
    assert out.finish_reason == "length" and out.completion_tokens == 6 and len(out.token_ids) == 6
    assert "".join(stream_generate(address, "Hello there", params, chat=True)) == out.text
    ids_out = generate(cluster["both"].router.address, [5, 6, 7], SamplingParams(max_tokens=3))
    assert ids_out.token_ids == expected([5, 6, 7], 3, TINY_VOCAB) and ids_out.text == ""
    with pytest.raises(InvalidArgument, match="max_tokens"):
        generate(address, "Hello", SamplingParams(max_tokens=100_000))
    check = subprocess.run([sys.executable, "-c", "import sys, pdserve.client; assert 'torch' not in sys.modules"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
