"""Metrics and tracing of router + prefill worker + decode worker as separate processes (CPU, Gloo).

After a few streamed requests each service's /metrics, parsed with prometheus-client's own
parser, counts what happened: requests, first tokens, tokens, KV transfers (the same bytes on
both sides), steps by kind; the KV cache is empty again once the requests ended. With spans
written to a file (PDSERVE_TRACE_FILE), one streamed request is one trace whose spans come from
all three processes and link to their parents.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench import deployment as services
from pdserve.v1 import common_pb2, router_pb2

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 2 + [k] for k in range(21, 25)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    logs = tmp_path_factory.mktemp("obs")
    spans = logs / "spans.jsonl"
    with pytest.MonkeyPatch.context() as mp:   # the services inherit the environment
        mp.setenv("PDSERVE_TRACE_FILE", str(spans))
        mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        mp.delenv("OTEL_TRACES_EXPORTER", raising=False)
        mp.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
        dep = services.start(logs, metrics=True)
    yield dep, spans
    dep.stop()


def _stream(dep, tokens: list[int], request_id: str = "") -> list[router_pb2.GenerateResponse]:
    req = router_pb2.GenerateRequest(request_id=request_id, token_ids=router_pb2.TokenIds(ids=tokens),
                                     params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                      ignore_eos=True))
    return list(dep.router_stub().Generate(req, timeout=120))


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics page."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def _total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _settled(dep, name: str, timeout: float = 10.0) -> dict:
    """``name``'s samples once nothing runs and no KV block is in use (bounded wait)."""
    end = time.monotonic() + timeout
    while True:
        s = _samples(dep.scrape(name))
        if (_value(s, "pdserve:kv_cache_usage_perc") == 0 and _value(s, "pdserve:num_requests_running") == 0
                and _value(s, "pdserve:num_requests_reserved") == 0) or time.monotonic() > end:
            return s
        time.sleep(0.1)


def test_metrics_count_what_happened(traced):
    dep, _ = traced
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = list(pool.map(lambda p: _stream(dep, p), PROMPTS))
    n = len(PROMPTS)
    tokens = sum(len(m.token_ids) for msgs in streams for m in msgs)
    gaps = sum(sum(1 for m in msgs if m.token_ids) - 1 for msgs in streams)
    assert tokens == n * MAX_TOKENS
    router, prefill, decode = (_samples(dep.scrape("router")), _settled(dep, "prefill0"), _settled(dep, "decode0"))

    # the router: every request took the remote route (a prefill worker is up)
    assert _value(router, "pdserve_router_time_to_first_token_seconds_count", route="remote") == n
    assert _value(router, "pdserve_router_time_to_first_token_seconds_count", route="local") == 0
    assert _value(router, "pdserve_router_inter_token_latency_seconds_count", route="remote") == gaps

    # the prefill worker computed each prompt and its first token, and sent each KV once
    assert _value(prefill, "pdserve:requests_total", rpc="Prefill") == n
    assert _value(prefill, "pdserve:time_to_first_token_seconds_count") == n
    assert _value(prefill, "pdserve:generation_tokens_total") == n
    assert _value(prefill, "pdserve:prompt_tokens_total") <= sum(map(len, PROMPTS))
    assert _value(prefill, "pdserve:prefix_cache_queries_total") >= sum(map(len, PROMPTS))
    assert _value(prefill, "pdserve:engine_step_duration_seconds_count", kind="prefill") >= 1
    assert _value(prefill, "pdserve:kv_transfer_size_bytes_count", direction="send") == n
    assert _value(prefill, "pdserve:kv_transfer_failures_total", direction="send") == 0

    # the decode worker received those bytes, decoded the rest and ended every request
    sent = _value(prefill, "pdserve:kv_transfer_size_bytes_sum", direction="send")
    assert sent > 0 and _value(decode, "pdserve:kv_transfer_size_bytes_sum", direction="recv") == sent
    assert _value(decode, "pdserve:kv_transfer_size_bytes_count", direction="recv") == n
    assert _value(decode, "pdserve:kv_transfer_failures_total", direction="recv") == 0
    assert _value(decode, "pdserve:requests_total", rpc="Reserve") == n
    assert _value(decode, "pdserve:request_success_total", finished_reason="length") == n
    assert _value(decode, "pdserve:e2e_request_latency_seconds_count") == n
    assert _value(decode, "pdserve:generation_tokens_total") == tokens - n
    assert _value(decode, "pdserve:inter_token_latency_seconds_count") == n * (MAX_TOKENS - 2)
    assert _value(decode, "pdserve:engine_step_duration_seconds_count", kind="decode") >= MAX_TOKENS - 1
    assert _value(decode, "pdserve:reservations_expired_total") == 0
    assert _value(decode, "pdserve:num_preemptions_total") == 0
    for s in (prefill, decode):          # the cache is empty again
        assert _value(s, "pdserve:kv_cache_usage_perc") == 0
        assert _value(s, "pdserve:num_requests_waiting") == 0
    # the same bytes as the workers' own counters (GetStats)
    assert dep.stats(dep.decode[0]).kv_transfer_bytes == sent == dep.stats(dep.prefill[0]).kv_transfer_bytes


def _trace_of(path: Path, request_id: str, timeout: float = 20.0) -> list[dict]:
    """The spans of the trace whose router spans carry ``request_id``, once all three services'
    phases and the router's server span (it ends last, after the stream) are in the file (bounded
    wait: spans are exported in batches)."""
    wanted = {"tokenize", "route", "queue_wait", "prefill", "kv_transfer", "kv_receive", "decode",
              "/pdserve.v1.Generation/Generate"}
    end = time.monotonic() + timeout
    while True:
        spans = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        ids = {s["trace_id"] for s in spans if s["attributes"].get("pdserve.request_id") == request_id}
        trace = [s for s in spans if s["trace_id"] in ids]
        if (len(ids) == 1 and wanted <= {s["name"] for s in trace}) or time.monotonic() > end:
            return trace
        time.sleep(0.2)


def test_one_request_is_one_trace_across_three_processes(traced):
    dep, path = traced
    msgs = _stream(dep, PROMPTS[0][:-1] + [99], request_id="trace-me")
    assert sum(len(m.token_ids) for m in msgs) == MAX_TOKENS
    trace = _trace_of(path, "trace-me")
    assert len({s["trace_id"] for s in trace}) == 1, trace
    services_seen = {s["service"] for s in trace}
    assert services_seen == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}, services_seen
    names = {(s["service"], s["name"]) for s in trace}
    for want in [("pdserve-router", "/pdserve.v1.Generation/Generate"), ("pdserve-router", "tokenize"),
                 ("pdserve-router", "route"), ("pdserve-router", "/pdserve.v1.Worker/Reserve"),
                 ("pdserve-prefill", "/pdserve.v1.Worker/Prefill"), ("pdserve-prefill", "queue_wait"),
                 ("pdserve-prefill", "prefill"), ("pdserve-prefill", "kv_transfer"),
                 ("pdserve-decode", "/pdserve.v1.Worker/PushKV"), ("pdserve-decode", "kv_receive"),
                 ("pdserve-decode", "queue_wait"), ("pdserve-decode", "decode")]:
        assert want in names, (want, sorted(names))
    # parent-linked: one root (the router's Generate), every other span's parent is in the trace
    by_id = {s["span_id"]: s for s in trace}
    roots = [s for s in trace if s["parent_id"] is None]
    assert [r["name"] for r in roots] == ["/pdserve.v1.Generation/Generate"]
    assert all(s["parent_id"] in by_id for s in trace if s["parent_id"] is not None)
    # the chain router -> prefill worker -> decode worker: PushKV under the prefill worker's KV transfer
    push = next(s for s in trace if s["name"] == "/pdserve.v1.Worker/PushKV" and s["kind"] == "SERVER")
    chain = []
    while push is not None:
        chain.append((push["service"], push["name"]))
        push = by_id.get(push["parent_id"])
    assert ("pdserve-prefill", "kv_transfer") in chain and ("pdserve-prefill", "/pdserve.v1.Worker/Prefill") in chain
    assert chain[-1] == ("pdserve-router", "/pdserve.v1.Generation/Generate")
    worker_spans = [s for s in trace if s["service"] != "pdserve-router" and s["kind"] == "INTERNAL"]
    assert all(s["attributes"].get("pdserve.request_id") for s in worker_spans)


def _python(code: str, env: dict[str, str]) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "PDSERVE_TRACE_FILE"}
    proc = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


def test_tracing_off_installs_nothing():
    """Without OTEL_* / PDSERVE_TRACE_FILE: no OpenTelemetry module loaded, no gRPC interceptor."""
    out = _python(
        "import sys, grpc.aio\n"
        "from pdserve.common import telemetry\n"
        "from pdserve.common.grpc_utils.server import build_server\n"
        "original = grpc.aio.server\n"
        "assert telemetry.setup_tracing('router') is False and not telemetry.enabled()\n"
        "assert grpc.aio.server is original\n"
        "with telemetry.span('x', 'r1'):\n"
        "    telemetry.bind_request('r1')\n"
        "telemetry.record_span('y', 0.0, 1.0, telemetry.parent(), 'r1')\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n", {})
    assert out.strip() == "[]", out


def test_json_logs_carry_request_and_trace_ids(tmp_path):
    out = _python(
        "import logging\n"
        "from pdserve.common import telemetry\n"
        "telemetry.configure_logging('INFO', 'json')\n"
        "assert telemetry.setup_tracing('router')\n"
        "with telemetry.span('tokenize', 'req-7'):\n"
        "    telemetry.bind_request('req-7')\n"
        "    logging.getLogger('pdserve.test').info('inside %s', 'a span')\n",
        {"PDSERVE_TRACE_FILE": str(tmp_path / "spans.jsonl")})
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    inside = [r for r in records if r["message"] == "inside a span"]
    assert len(inside) == 1 and inside[0]["request_id"] == "req-7" and inside[0]["level"] == "INFO"
    assert re.fullmatch(r"[0-9a-f]{32}", inside[0]["trace_id"]) and inside[0]["trace_id"] != "0" * 32
    spans = [json.loads(line) for line in (tmp_path / "spans.jsonl").read_text().splitlines()]
    assert [s["trace_id"] for s in spans if s["name"] == "tokenize"] == [inside[0]["trace_id"]]
