"""The OpenAI HTTP API of the router, driven by clients nobody in the project wrote.

Against ``pdserve up`` (router + prefill + decode processes, embedded model, CPU): the official
``openai`` SDK, unmodified, streams and completes chat and text requests whose greedy output
equals the gRPC API's; bad requests raise the SDK's own exception classes; a client that goes
away mid-stream (or before its answer) leaves both workers' block pools whole. A second router
(no live worker, bearer tokens on) shows 401 (the same tokens as its gRPC API), 503 and 413.
A third-party load generator (guidellm, from the registry, unmodified) and ``pdserve bench serve
--backend openai`` each measure TTFT and ITL on the chat endpoint within 10% of what the router
itself measured for the same requests (its /metrics sums read before and after each run). The
reference is the router's own figure for that run, not the other tool's runs: on the shared 2-core
CI machine the server's speed drifts 20-30% between runs (bench serve's own runs spanned 140-187 ms
of TTFT), while each tool agreed with the router within 2% in every run seen.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from pdserve.loadtest.ports import free_port
from pdserve.loadtest.procs import Service
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

QUESTION = "What is the capital of France?"
TOKEN = "s3cret-token-for-tests"


@pytest.fixture(scope="module")
def dep(openai_up):
    """`pdserve up`, HTTP on a free port, the router's /metrics in ``metrics["router"]``: the
    session's (tests/integration/conftest.py), not one more start of the same services."""
    return openai_up


@pytest.fixture(scope="module")
def client(dep) -> openai.OpenAI:
    return openai.OpenAI(base_url=dep.http, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _grpc(dep, request: router_pb2.GenerateRequest) -> router_pb2.GenerateResult:
    with grpc.insecure_channel(dep.router) as ch:
        return router_pb2_grpc.GenerationStub(ch).GenerateUnary(request, timeout=120)


def _greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)


def test_sdk_streams_a_chat_answer_equal_to_grpc(dep, client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=32,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert "Paris" in text, text
    assert chunks[0].choices[0].delta.role == "assistant" and finish == ["stop"]
    want = _grpc(dep, router_pb2.GenerateRequest(
        chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=QUESTION)]),
        params=_greedy(32)))
    assert text == want.text
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.usage.prompt_tokens, want.usage.completion_tokens)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           temperature=0, max_tokens=32)
    assert again.choices[0].message.content == want.text and again.choices[0].finish_reason == "stop"
    assert again.usage.prompt_tokens_details.cached_tokens > 0      # the same prompt: a prefix-cache hit


def test_sdk_text_completion_equal_to_grpc(dep, client, model):
    prompt = "The capital of France is"
    r = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12)
    want = _grpc(dep, router_pb2.GenerateRequest(text=prompt, params=_greedy(12)))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (want.usage.prompt_tokens, 12)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt=prompt, temperature=0, max_tokens=12, stream=True) if c.choices)
    assert streamed == want.text
    batch = client.completions.create(model=model, prompt=[prompt, "Name three primary colors."], temperature=0,
                                      max_tokens=12)                    # two prompts: two choices
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == want.text
    assert batch.usage.completion_tokens == 24
    ids = list(want.token_ids[:4])     # token ids as the prompt, with the chosen tokens' logprobs
    r = client.completions.create(model=model, prompt=ids, temperature=0, max_tokens=6, logprobs=0)
    want = _grpc(dep, router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                 params=common_pb2.SamplingParams(temperature=0, max_tokens=6,
                                                                                  logprobs=True)))
    lp = r.choices[0].logprobs
    assert r.choices[0].text == want.text and "".join(lp.tokens) == want.text
    assert lp.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-4)


@pytest.mark.parametrize("kwargs, param", [
    ({"top_p": 2.0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"temperature": "hot"}, "temperature"),
])
def test_bad_requests_raise_the_sdks_bad_request_error(client, model, kwargs, param):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == 400 and e.value.param == param and param in e.value.message


def test_unknown_model_and_oversized_body(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.APIStatusError) as e:     # 9 MB > the default 8 MiB limit
        client.completions.create(model="x", prompt="a" * 9_000_000, max_tokens=4)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"


def test_client_gone_mid_stream_or_before_its_answer_frees_both_pools(dep, client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=400,
        stream=True, extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    stream.close()                                      # the connection goes; the request must too
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])
    impatient = openai.OpenAI(base_url=dep.http, api_key="unused", max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):         # not streamed: gone before the answer
        impatient.completions.create(model=model, prompt="Once upon a time", max_tokens=400,
                                     extra_body={"ignore_eos": True})
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])


@pytest.fixture(scope="module")
def guarded_router(tmp_path_factory):
    """A router with bearer tokens, a 4 KiB body limit and no live worker."""
    tmp = tmp_path_factory.mktemp("guarded")
    (tmp / "tokens").write_text(f"# accepted tokens\n{TOKEN}\n")
    port, http = free_port(), free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", "0", "--decode", f"127.0.0.1:{free_port()}", "--startup-wait-s", "0",
           "--auth-tokens-file", str(tmp / "tokens"), "--http-port", str(http), "--http-max-body-bytes", "4096"]
    svc = Service("guarded-router", cmd, "", tmp / "router.log").start()
    url = f"http://127.0.0.1:{http}"
    try:
        _wait_http(url + "/health", 60, svc)
        yield f"127.0.0.1:{port}", url + "/v1"
    finally:
        svc.stop()


def _wait_http(url: str, timeout: float, svc: Service) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert svc.alive(), f"{svc.name} exited:\n{svc.log_tail()}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout} s:\n{svc.log_tail()}")


def test_auth_overload_and_body_limit(guarded_router):
    address, url = guarded_router
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=url, api_key="wrong-token", max_retries=0).models.list()
    assert e.value.code == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as h:           # no Authorization header at all
        urllib.request.urlopen(urllib.request.Request(url + "/completions", data=b'{"prompt": "hi"}'), timeout=10)
    assert h.value.code == 401 and json.loads(h.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as r:    # open, as gRPC health
        assert r.status == 200
    ok = openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0)
    model = ok.models.list().data[0].id
    with pytest.raises(openai.InternalServerError) as e:        # no decode worker is up: 503
        ok.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert e.value.status_code == 503 and e.value.response.headers.get("retry-after") == "1"
    with pytest.raises(openai.APIStatusError) as e:
        ok.completions.create(model=model, prompt="a" * 5000, max_tokens=4)
    assert e.value.status_code == 413
    request = router_pb2.GenerateRequest(text="hi", params=_greedy(4))
    with grpc.insecure_channel(address) as ch:                 # the same tokens guard the gRPC API
        stub = router_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as g:
            stub.GenerateUnary(request, timeout=30)
        assert g.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as g:
            stub.GenerateUnary(request, timeout=30, metadata=[("authorization", f"Bearer {TOKEN}")])
        assert g.value.code() == grpc.StatusCode.UNAVAILABLE


# ---- a third-party load generator --------------------------------------------------------
LOADGEN_QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
                     "Who wrote Hamlet?", "What is 2+2?", "Translate 'cat' into French.", "Why is the sky blue?",
                     "What is a prime number?", "How many legs has a spider?", "Who painted the Mona Lisa?"]
LOADGEN_OUTPUT_TOKENS = 12
LOADGEN_REPEAT = 2      # each question twice a run (once was within 10% on a quiet machine, 11.7% off on a loaded one)
LOADGEN_REQUESTS = LOADGEN_REPEAT * len(LOADGEN_QUESTIONS)
# Each tool's mean TTFT and mean ITL of a run over the router's own for the same requests must lie in
# 1 +/- AGREE (seen: TTFT +0.2% to +2%, ITL -0.3% to +0.1%, while the runs themselves moved 145-189 ms).
AGREE = 0.10


def _chat_dataset(path) -> None:
    """One line per request, read by both tools: guidellm's column names and pdserve's."""
    n = LOADGEN_OUTPUT_TOKENS
    path.write_text("".join(json.dumps({"prompt": q, "max_tokens": n, "output_tokens_count": n}) + "\n"
                            for q in LOADGEN_QUESTIONS * LOADGEN_REPEAT))


def _bench_serve(dep, data, out_dir, name: str) -> dict:
    """``pdserve bench serve --backend openai`` on the chat endpoint, one request at a time."""
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--backend", "openai", "--endpoint", "chat",
           "--base-url", dep.http, "--dataset", "jsonl", "--dataset-path", str(data), "--ignore-eos",
           "--temperature", "1.0", "--max-concurrency", "1", "--num-warmups", "1", "--no-plots", "--disable-tqdm",
           "--result-dir", str(out_dir), "--result-filename", name]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"bench serve failed:\n{r.stdout}\n{r.stderr}"
    res = json.loads((out_dir / f"{name}.json").read_text())["results"][0]
    assert res["completed"] == LOADGEN_REQUESTS
    return {"ttft": res["mean_ttft_ms"], "itl": res["mean_itl_ms"]}


def _guidellm(dep, data, out_dir) -> dict:
    """guidellm (unmodified, its own CLI) on the same requests: streamed chat, one at a time.
    Sampling is the server's default (temperature 1), as the bench run asks for."""
    from pdserve.common.default_model import ensure_default_model
    out = out_dir / "guidellm.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={dep.http.removesuffix('/v1')},request_format=/v1/chat/completions",
           "--profile", "kind=concurrent,streams=1",
           "--constraint", f"kind=max_requests,count={LOADGEN_REQUESTS}",
           "--data", f"kind=json_file,path={data}",
           "--tokenizer", f"kind=huggingface_auto,model={ensure_default_model()}",
           "--output", f"kind=json,path={out}", "--disable-console"]
    # one worker process (its default spawns up to 10, each a few seconds of start-up on 2 cores)
    env = dict(os.environ, GUIDELLM__MAX_WORKER_PROCESSES="1",
               GUIDELLM__LOGGING__LOG_FILE=str(out_dir / "guidellm.log"))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out_dir, env=env)
    assert r.returncode == 0, f"guidellm failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    # guidellm's max_requests constraint sometimes ends the run one request early (seen: total 9 of
    # 10, none errored or incomplete): what it did send must all have succeeded
    totals = m["request_totals"]
    assert totals["errored"] == 0 and totals["incomplete"] == 0, totals
    assert LOADGEN_REQUESTS - 1 <= totals["successful"] <= LOADGEN_REQUESTS, totals
    return {"ttft": m["time_to_first_token_ms"]["successful"]["mean"],
            "itl": m["inter_token_latency_ms"]["successful"]["mean"]}


def _router_totals(dep) -> dict[str, float]:
    """The router's running sums: TTFT and end-to-end seconds, requests, output tokens."""
    from prometheus_client.parser import text_string_to_metric_families
    want = {"pdserve_router_ttft_seconds_sum": "ttft_s", "pdserve_router_ttft_seconds_count": "requests",
            "pdserve_router_e2e_seconds_sum": "e2e_s", "pdserve_router_output_tokens_total": "tokens"}
    out = dict.fromkeys(want.values(), 0.0)
    for family in text_string_to_metric_families(dep.scrape("router")):
        for s in family.samples:
            if s.name in want:
                out[want[s.name]] += s.value
    return out


def _served(dep, run) -> tuple[dict, dict]:
    """``run()``'s figures and the router's own for the requests of that run: mean TTFT (receipt to
    first token sent) and mean ITL ((end to end - TTFT) over the tokens after the first), in ms."""
    before = _router_totals(dep)
    figures = run()
    after = _router_totals(dep)
    d = {k: after[k] - before[k] for k in after}
    return figures, {"ttft": 1e3 * d["ttft_s"] / d["requests"],
                     "itl": 1e3 * (d["e2e_s"] - d["ttft_s"]) / (d["tokens"] - d["requests"])}


def _process_tree(root: int) -> list[int]:
    """``root`` and every process below it (``pdserve up`` starts each service in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


@contextlib.contextmanager
def _cores_apart(dep):
    """The deployment's every thread on the first core, this process (and the tools it starts) on the
    others, then all back: a load generator's own CPU then cannot slow the server it measures."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or not os.path.isdir("/proc"):
        yield
        return
    def pin(pids, cpus):
        for pid in pids:
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(tid), cpus)
    server = _process_tree(dep.services["up"].proc.pid)
    pin(server, {cores[0]})
    os.sched_setaffinity(0, set(cores[1:]))
    try:
        yield
    finally:
        os.sched_setaffinity(0, set(cores))
        pin(server, set(cores))


@pytest.mark.slow
def test_load_generators_agree_with_the_router(dep, client, model, tmp_path):
    data = tmp_path / "chat.jsonl"
    _chat_dataset(data)
    for q in LOADGEN_QUESTIONS:     # every prompt's KV cached first: each run below finds the same cache
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": q}], max_tokens=1)
    with _cores_apart(dep):                 # the tools' own CPU kept off the server's core
        runs = {"pdserve bench serve": _served(dep, lambda: _bench_serve(dep, data, tmp_path, "bench")),
                "guidellm": _served(dep, lambda: _guidellm(dep, data, tmp_path))}
    report = "; ".join(f"{tool}: {fig} against the router's {served} (ms)" for tool, (fig, served) in runs.items())
    print(report)
    for tool, (fig, served) in runs.items():
        for k in ("ttft", "itl"):
            assert abs(fig[k] / served[k] - 1) <= AGREE, \
                f"{tool}'s {k} is not within {AGREE:.0%} of the router's: {report}"
