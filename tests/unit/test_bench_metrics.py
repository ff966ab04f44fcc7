"""pdserve bench serve: metric arithmetic on a hand-made trace, datasets, arrivals, and a short
end-to-end run of the load generator against the router + scripted workers (separate processes)."""
from __future__ import annotations

import importlib.util
import json
import math
import time

import numpy as np
import pytest

from pdserve.loadtest import arrivals, datasets, metrics
from pdserve.loadtest.metrics import RequestRecord, compute_metrics

approx = pytest.approx


# ---- a recorded trace, answers by hand --------------------------------------------------
def _rec(i, send, msgs, end, code="OK", out=None, prompt=0, error=""):
    r = RequestRecord(index=i, scheduled_time=send, release_time=send, send_time=send,
                      msg_times=[t for t, _ in msgs], msg_tokens=[k for _, k in msgs], end_time=end, code=code,
                      error=error, prompt_tokens=prompt)
    r.output_tokens = out if out is not None else sum(k for _, k in msgs)
    return r


def trace() -> list[RequestRecord]:
    return [
        # A: 1 + 1 + 3 + 1 tokens; TTFT 100, E2E 175, TPOT (175-100)/5 = 15; gaps 20, 30, 20
        _rec(0, 0.0, [(0.100, 1), (0.120, 1), (0.150, 3), (0.170, 1)], 0.175, prompt=10, out=6),
        # B: 2 tokens in the first message, then an empty final message; TTFT 50, E2E 65, TPOT 15
        _rec(1, 1.0, [(1.050, 2), (1.060, 0)], 1.065, prompt=20, out=2),
        # C: a single token; TTFT 200, E2E 201, no TPOT (0 for goodput)
        _rec(2, 2.0, [(2.200, 1)], 2.201, prompt=5, out=1),
        # failures
        _rec(3, 2.5, [], 2.6, code="UNAVAILABLE", prompt=7, error="no decode worker is up"),
        _rec(4, 2.6, [], 2.7, code="RESOURCE_EXHAUSTED", prompt=7),
        _rec(5, 2.7, [(2.8, 1)], 3.0, code="DEADLINE_EXCEEDED", prompt=7),   # partial output, still a failure
        _rec(6, 2.8, [(2.9, 0)], 2.95, code="OK", prompt=7),                   # OK without a token
    ]


def test_per_request_values():
    a, b, c = trace()[:3]
    assert a.ttft() == approx(0.100) and a.e2el() == approx(0.175) and a.tpot() == approx(0.015)
    assert a.itls("chunk") == approx([0.020, 0.030, 0.020])
    assert a.itls("split") == approx([0.020, 0.010, 0.010, 0.010, 0.020])
    assert b.ttft() == approx(0.050) and b.tpot() == approx(0.015)
    assert b.itls("chunk") == [] and b.itls("split") == []   # the first message's extra token: no ITL entry
    assert c.tpot() == 0.0 and c.itls() == []
    assert [r.status for r in trace()[3:]] == ["UNAVAILABLE", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED",
                                               "EMPTY_STREAM"]


def test_aggregate_metrics_by_hand():
    m = compute_metrics(trace(), duration_s=4.0, percentiles=(50, 90, 99, 99.9))
    assert m["completed"] == 3 and m["failed"] == 4 and m["num_requests"] == 7
    assert m["error_counts"] == {"DEADLINE_EXCEEDED": 1, "EMPTY_STREAM": 1, "RESOURCE_EXHAUSTED": 1, "UNAVAILABLE": 1}
    # successful requests only, as vLLM
    assert m["total_input_tokens"] == 35 and m["total_output_tokens"] == 9
    assert m["request_throughput"] == approx(0.75)
    assert m["output_throughput"] == approx(9 / 4)
    assert m["total_token_throughput"] == approx(44 / 4)
    assert m["request_goodput"] is None
    # TTFT [100, 50, 200]
    assert m["mean_ttft_ms"] == approx(350 / 3)
    assert m["median_ttft_ms"] == approx(100)
    assert m["std_ttft_ms"] == approx(
        math.sqrt(((100 - 350 / 3) ** 2 + (50 - 350 / 3) ** 2 + (200 - 350 / 3) ** 2) / 3))
    assert m["p90_ttft_ms"] == approx(180)      # linear: 100 + 0.8 * (200 - 100)
    assert m["p99_ttft_ms"] == approx(198)
    assert m["p99.9_ttft_ms"] == approx(199.8)  # vLLM's key spelling of a fractional percentile
    assert m["p50_ttft_ms"] == approx(100)
    # TPOT over requests with > 1 token: [15, 15]
    assert m["mean_tpot_ms"] == approx(15) and m["p99_tpot_ms"] == approx(15) and m["std_tpot_ms"] == approx(0)
    # ITL, vLLM (one entry per message): [20, 30, 20]
    assert m["mean_itl_ms"] == approx(70 / 3) and m["median_itl_ms"] == approx(20)
    assert m["p90_itl_ms"] == approx(28)
    # E2E [175, 65, 201]
    assert m["mean_e2el_ms"] == approx(147) and m["median_e2el_ms"] == approx(175)
    assert m["mean_tokens_per_message"] == approx(9 / 6)
    assert m["max_concurrent_requests"] == 1 and m["max_output_tokens_per_s"] == 6


def test_itl_split_mode():
    m = compute_metrics(trace(), 4.0, itl_mode="split")
    assert m["mean_itl_ms"] == approx(14) and m["median_itl_ms"] == approx(10)   # [20, 10, 10, 10, 20]
    with pytest.raises(ValueError):
        compute_metrics(trace(), 4.0, itl_mode="bogus")


def test_goodput_with_slos():
    slo = metrics.parse_slo("ttft_ms=100,tpot_ms=15")
    assert slo == {"ttft": 100.0, "tpot": 15.0}
    m = compute_metrics(trace(), 4.0, slo=slo)
    assert m["good_completed"] == 2 and m["request_goodput"] == approx(0.5)    # A (ttft == SLO) and B
    m = compute_metrics(trace(), 4.0, slo=metrics.parse_slo("ttft_ms=100,e2e_ms=100"))
    assert m["request_goodput"] == approx(0.25)                                 # B only
    m = compute_metrics(trace(), 4.0, slo=metrics.parse_slo(["tpot:10"]))       # vLLM spelling
    assert m["request_goodput"] == approx(0.25)                                 # C: a 1-token request has TPOT 0
    assert metrics.parse_slo(["ttft:1", "e2el:2"]) == {"ttft": 1.0, "e2el": 2.0}
    for bad in ("ttft=", "latency_ms=5", "ttft_ms=-1"):
        with pytest.raises(ValueError):
            metrics.parse_slo(bad)


def test_empty_and_table():
    m = compute_metrics([_rec(0, 0.0, [], 0.1, code="UNAVAILABLE")], 1.0)
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["error_counts"] == {"UNAVAILABLE": 1}
    text = metrics.format_table(compute_metrics(trace(), 4.0, slo={"ttft": 100}))
    assert "Request goodput (req/s):" in text and "P99 TTFT (ms):" in text and "UNAVAILABLE" in text
    d = metrics.detailed_lists(trace())
    assert d["output_lens"][:3] == [6, 2, 1] and d["ttfts"][1] == approx(0.05) and d["errors"][3]


# ---- datasets -----------------------------------------------------------------------------
def test_w_nano_is_the_design_workload():
    reqs = datasets.build("w-nano")
    assert len(reqs) == 256
    assert sum(r.prompt_len for r in reqs) == 142_827 and sum(r.output_len for r in reqs) == 133_966
    assert all(r.temperature == 0.6 and r.ignore_eos and max(r.token_ids) <= 10000 for r in reqs)


@pytest.mark.parametrize("name,lo_in,hi_in,lo_out,hi_out", [
    ("random", 128, 1024, 64, 256), ("prefill-heavy", 1792, 2304, 16, 64), ("decode-heavy", 64, 128, 512, 512)])
def test_synthetic_datasets(name, lo_in, hi_in, lo_out, hi_out):
    a = datasets.build(name, num_prompts=50, vocab=1000, seed=3)
    assert a == datasets.build(name, num_prompts=50, vocab=1000, seed=3)          # deterministic
    assert a != datasets.build(name, num_prompts=50, vocab=1000, seed=4)
    assert len(a) == 50
    assert all(lo_in <= r.prompt_len <= hi_in and len(r.token_ids) == r.prompt_len for r in a)
    assert all(lo_out <= r.output_len <= hi_out for r in a)
    assert all(0 <= t < 1000 for r in a for t in r.token_ids)
    b = datasets.build(name, num_prompts=7, input_len="10:12", output_len=5, vocab=1000)
    assert all(10 <= r.prompt_len <= 12 and r.output_len == 5 for r in b)


def test_shared_prefix():
    reqs = datasets.build("shared-prefix", num_prompts=40, num_prefixes=4, prefix_len=64, input_len="8:16",
                          vocab=500, seed=1)
    assert len(reqs) == 40
    prefixes = {tuple(r.token_ids[:64]) for r in reqs}
    assert len(prefixes) == 4
    assert all(72 <= r.prompt_len <= 80 for r in reqs)
    assert sorted(r.extra["prefix"] for r in reqs) == sorted(i % 4 for i in range(40))
    assert [r.extra["prefix"] for r in reqs[:8]] != [i % 4 for i in range(8)]   # shuffled


@pytest.mark.parametrize("name", ["random", "prefill-heavy", "shared-prefix", "multi-turn", "w-nano"])
def test_variants_keep_lengths_and_shared_prompts_but_change_the_rest(name):
    kw = {"num_prompts": 24, "vocab": 500, "seed": 2, "num_prefixes": 3, "prefix_len": 32, "input_len": "8:40",
          "output_len": "4:8"} if name != "w-nano" else {"num_prompts": 24}
    base = datasets.build(name, **kw)
    one, two = (datasets.build(name, variant=k, **kw) for k in (1, 2))
    assert one == datasets.build(name, variant=1, **kw)                              # deterministic
    shared = 32 if name in ("shared-prefix", "multi-turn") else 0
    vocab = 500 if name != "w-nano" else datasets.W_NANO_VOCAB
    for a, b, c in zip(base, one, two):
        assert (a.prompt_len, a.output_len, a.extra) == (b.prompt_len, b.output_len, b.extra) == \
            (c.prompt_len, c.output_len, c.extra)
        assert a.token_ids[:shared] == b.token_ids[:shared] == c.token_ids[:shared]
        shift = 7919 % vocab
        assert b.token_ids[shared:] == [(t + shift) % vocab for t in a.token_ids[shared:]]
        assert len({tuple(x.token_ids[shared:]) for x in (a, b, c)}) == 3 and max(c.token_ids) < vocab
    if name == "multi-turn":                   # a next turn still starts with its previous turn's prompt
        by_turn = {(r.extra["conversation"], r.extra["turn"]): r.token_ids for r in one}
        for (conv, turn), ids in by_turn.items():
            if turn and (conv, turn - 1) in by_turn:
                assert ids[:len(by_turn[conv, turn - 1])] == by_turn[conv, turn - 1]


def test_jsonl_and_protos(tmp_path):
    f = tmp_path / "reqs.jsonl"
    f.write_text("\n".join([json.dumps({"prompt": "Hello there", "max_tokens": 7}),
                            json.dumps({"messages": [{"role": "user", "content": "Hi"}]}),
                            json.dumps({"token_ids": [5, 6, 7], "max_tokens": 3}), ""]))
    reqs = datasets.build("jsonl", dataset_path=str(f), output_len=11)
    assert [r.output_len for r in reqs] == [7, 11, 3]
    assert not any(r.ignore_eos for r in reqs)
    p0, p1, p2 = (r.to_proto(f"id{i}") for i, r in enumerate(reqs))
    assert p0.WhichOneof("input") == "text" and p0.text == "Hello there" and p0.params.max_tokens == 7
    assert p1.WhichOneof("input") == "chat" and p1.chat.messages[0].content == "Hi"
    assert p2.WhichOneof("input") == "token_ids" and list(p2.token_ids.ids) == [5, 6, 7]
    assert p2.request_id == "id2"
    assert len(datasets.build("jsonl", dataset_path=str(f), num_prompts=5)) == 5        # cycles
    text = datasets.build("random", num_prompts=3, input_len=20, prompt_format="text")
    assert all(r.text and r.token_ids is None and len(r.text.split()) == 20 for r in text)
    with pytest.raises(ValueError):
        datasets.build("random", num_prompts=2, input_len=1000, output_len=100, max_model_len=512)


# ---- arrivals -----------------------------------------------------------------------------
def test_poisson_arrivals():
    t = arrivals.arrival_times(20_000, rate=10.0, burstiness=1.0, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == approx(0.1, rel=0.03)
    assert gaps.std() / gaps.mean() == approx(1.0, rel=0.05)          # exponential: CV 1
    assert np.array_equal(t, arrivals.arrival_times(20_000, 10.0, 1.0, seed=0))
    assert not np.array_equal(t, arrivals.arrival_times(20_000, 10.0, 1.0, seed=1))


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness(burstiness):
    gaps = np.diff(arrivals.arrival_times(40_000, rate=5.0, burstiness=burstiness, seed=2))
    assert gaps.mean() == approx(0.2, rel=0.04)                      # the rate does not depend on burstiness
    assert (gaps.std() / gaps.mean()) ** 2 == approx(1 / burstiness, rel=0.1)


def test_arrival_edge_cases():
    assert np.all(arrivals.arrival_times(5, math.inf) == 0)
    assert np.allclose(np.diff(arrivals.arrival_times(5, 4.0, burstiness=math.inf)), 0.25)
    t = arrivals.arrival_times(100, 2.0, seed=5, normalize=True)
    assert t[-1] == approx(99 / 2.0)
    assert arrivals.parse_rates("1, 2,inf") == [1.0, 2.0, math.inf]
    assert arrivals.split_concurrency(10, 3) == [4, 3, 3] and arrivals.split_concurrency(None, 2) == [None, None]
    for bad in ("0", "-1", "x"):
        with pytest.raises(ValueError):
            arrivals.parse_rate(bad)


# ---- end to end: generator -> router -> scripted worker (separate processes) --------------
_HAVE_SERVICES = (importlib.util.find_spec("pdserve.loadtest.scripted_worker") is not None
                  and importlib.util.find_spec("pdserve.router.main") is not None)


@pytest.fixture(scope="module")
def router_addr(tmp_path_factory):
    if not _HAVE_SERVICES:
        pytest.skip("router or scripted worker not available")
    from pdserve.loadtest import ports, procs
    logs = tmp_path_factory.mktemp("logs")
    wport, rport = ports.free_ports(2, 2)
    services = [procs.scripted_worker(wport, "both", step_ms=2.0, log_dir=logs).start(),
                procs.router(rport, decode=[f"127.0.0.1:{wport}"], log_dir=logs).start()]
    try:
        procs.wait_ready(services, 60)
        procs.wait_workers(services[1].address, 1, 1, 30)
        yield services[1].address
    finally:
        procs.stop_all(services)


def test_serve_end_to_end(router_addr, tmp_path):
    from pdserve.cli.cmd_bench import main
    t0 = time.monotonic()
    rc = main(["serve", "--router", router_addr, "--dataset", "random", "--num-prompts", "24", "--input-len", "32:256",
               "--output-len", "4:24", "--request-rate", "40,inf", "--slo", "ttft_ms=2000,tpot_ms=500",
               "--num-client-procs", "2", "--result-dir", str(tmp_path), "--result-filename", "run",
               "--disable-tqdm", "--save-detailed", "--percentiles", "50,99"])
    assert rc == 0
    data = json.loads((tmp_path / "run.json").read_text())
    assert data["model_info"]["vocab_size"] > 0 and data["dataset"]["num_prompts"] == 24
    assert [r["request_rate"] for r in data["results"]] == [40.0, "inf"]
    assert [r["prompt_variant"] for r in data["results"]] == [1, 2]
    assert data["results"][1]["total_cached_tokens"] == 0      # its own prompts: nothing cached by the first
    for r in data["results"]:
        for key in ("completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                    "request_goodput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                    "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                    "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms", "duration", "error_counts"):
            assert key in r, key
        assert r["completed"] == 24 and r["failed"] == 0
        assert r["total_input_tokens"] == data["dataset"]["total_prompt_tokens"]   # usage.prompt_tokens
        assert r["total_output_tokens"] == data["dataset"]["total_max_tokens"]     # ignore_eos: all of max_tokens
        assert r["request_goodput"] is not None and r["mean_ttft_ms"] > 0
        assert r["client"]["num_procs"] == 2 and len(r["client"]["procs"]) == 2
        assert all(p["cpu_user_s"] + p["cpu_sys_s"] > 0 for p in r["client"]["procs"])
        assert len(r["detailed"]["ttfts"]) == 24 and r["detailed"]["extra"] == [{}] * 24   # random: no extra
    assert (tmp_path / "run_latency_cdf.png").stat().st_size > 1000
    assert (tmp_path / "run_throughput.png").stat().st_size > 1000
    assert time.monotonic() - t0 < 40


def test_compare_two_targets(router_addr, tmp_path):
    from pdserve.cli.cmd_bench import main
    rc = main(["compare", "--targets", f"a={router_addr},b={router_addr}", "--num-prompts", "10",
               "--output-len", "4:8", "--request-rate", "inf", "--max-concurrency", "4", "--slo", "ttft_ms=5000",
               "--result-dir", str(tmp_path), "--result-filename", "cmp", "--disable-tqdm", "--num-warmups", "0"])
    assert rc == 0
    data = json.loads((tmp_path / "cmp.json").read_text())
    assert [d["name"] for d in data["deployments"]] == ["a", "b"]
    assert all(d["results"][0]["completed"] == 10 for d in data["deployments"])
    assert data["deployments"][0]["results"][0]["max_concurrent_requests"] <= 4
    # the k-th run of every deployment sends the same prompts; here both targets are one router, so
    # b's run finds a's prompts cached (and serve's test above shows that another run's do not)
    assert [d["results"][0]["prompt_variant"] for d in data["deployments"]] == [1, 1]
    assert data["deployments"][1]["results"][0]["total_cached_tokens"] > 0
    assert "| inf (conc 4) | a |" in data["table_markdown"]
    assert (tmp_path / "cmp_goodput.png").exists() and (tmp_path / "cmp.md").exists()


def test_router_overhead_smoke(tmp_path):
    if not _HAVE_SERVICES:
        pytest.skip("router or scripted worker not available")
    from pdserve.cli.cmd_bench import main
    out = tmp_path / "ro.json"
    rc = main(["router-overhead", "--num-requests", "6", "--prompt-len", "256", "--latency-max-tokens", "4",
               "--fanout-concurrency", "4", "--fanout-max-tokens", "16", "--fanout-rounds", "1",
               "--idle-measure-s", "0.5",
               "--output", str(out), "--log-dir", str(tmp_path / "logs")])
    assert rc == 0
    data = json.loads(out.read_text())
    for setup in ("colocated", "disagg"):
        lat = data["latency"][setup]
        assert lat["direct"]["ttft"]["p50"] > 0 and lat["router"]["ttft"]["p50"] > 0
        assert set(lat["added_ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    (f,) = data["fanout"]
    assert f["completed"] == 4 and f["tokens_per_s"] > 0 and f["direct_tokens_per_s"] > 0 and f["router_cpu_s"] >= 0


def test_compare_helpers():
    from pdserve.loadtest import compare
    (a, a_args), (b, b_args) = compare.default_up_configs("0,1")
    assert a_args == "--prefill 1 --decode 1 --prefill-gpus 0 --decode-gpus 1"
    assert b_args == "--prefill 0 --decode 2 --role both --decode-gpus 0,1"
    assert compare.expected_workers(a_args) == (1, 1) and compare.expected_workers(b_args) == (2, 2)
    assert compare.expected_processes(a_args) == 4 and compare.expected_processes(b_args) == 4
    assert compare.parse_targets("x=h:1,y=h:2") == [("x", "h:1"), ("y", "h:2")]
    with pytest.raises(ValueError):
        compare.parse_targets("h:1")
    m = compute_metrics(trace(), 4.0)
    table = compare.markdown_table([("x", [{**m, "request_rate": 2.0, "max_concurrency": None}]),
                                    ("y", [{**m, "request_rate": 2.0, "max_concurrency": None}])])
    lines = table.splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 2 | x | 3 | 4 | 0.75 | - |")
