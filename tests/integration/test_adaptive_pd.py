"""Adaptive prefill placement, as separate processes on the CPU (embedded model, Gloo): a router
with ``--pd-policy adaptive`` in front of one ``prefill`` worker and one ``both`` worker.

The thresholds make both kinds of decision occur: prompts whose uncached part is at most
``--pd-local-max-tokens`` (set between the short and the long prompts) are prefilled on the
both worker (local, Submit); an unattainable TPOT SLO sends every longer prompt to the option
that adds nothing to the decode worker's steps (remote: Reserve on the both worker, Prefill on
the prefill worker, KV over the pair channel). Greedy outputs must equal the offline engine's,
and both pools end whole, also after a cancel in each path.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import deployment as services
from pdserve.common.engine import LLM, SamplingParams
from pdserve.v1 import common_pb2, router_pb2

MAX_TOKENS = 12
SHORT = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?", "Who wrote Hamlet?"]
TOPICS = ["railway timetables", "alpine botany", "medieval bookbinding", "harbour logistics", "glacier physics",
          "violin making"]


def _long_system(topic: str) -> str:
    return (f"{topic.capitalize()} is your only field. You are a careful expert in {topic}; answer briefly, cite "
            f"sources on {topic} exactly, and when unsure about {topic} say so plainly. ") * 2


@pytest.fixture(scope="module")
def offline():
    return LLM("default", device="cpu", num_kv_blocks=1024)


@pytest.fixture(scope="module")
def prompts(offline) -> dict[str, list[list[int]]]:
    short = [offline.apply_chat_template([{"role": "user", "content": q}]) for q in SHORT]
    long = [offline.apply_chat_template([{"role": "system", "content": _long_system(t)},
                                         {"role": "user", "content": "Where do I start?"}]) for t in TOPICS]
    assert max(map(len, short)) + 32 < min(map(len, long))
    return {"short": short, "long": long}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, prompts):
    threshold = max(map(len, prompts["short"])) + 16
    dep = services.start(tmp_path_factory.mktemp("logs"), decode_role="both", metrics=True,
                         router_args=["--pd-policy", "adaptive", "--pd-local-max-tokens", str(threshold),
                                      "--slo-tpot-ms", "0.001"])
    yield dep
    dep.stop()


def _request(tokens: list[int], max_tokens: int = MAX_TOKENS) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens),
                                      params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def _stream(dep, tokens: list[int]) -> list[int]:
    return [t for msg in dep.router_stub().Generate(_request(tokens), timeout=180) for t in msg.token_ids]


def _counter(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with these labels in /metrics text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _whole(dep) -> None:
    dep.wait_whole(dep.decode[0])
    dep.wait_whole(dep.prefill[0])


def test_both_decisions_outputs_match_offline_and_pools_whole(deployment, offline, prompts):
    # the first three long prompts and every short one, concurrently; the others stay fresh for
    # the cancel tests (a prompt already imported into the both worker is cached there: local)
    batch = prompts["short"] + prompts["long"][:3]
    expected = [o.token_ids for o in offline.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                      use_tqdm=False)]
    with ThreadPoolExecutor(len(batch)) as pool:
        got = list(pool.map(lambda p: _stream(deployment, p), batch))
    assert got == expected
    text = deployment.scrape("router")
    decisions = "pdserve_router_pd_decisions_total"
    assert _counter(text, decisions, kind="local", reason="short-prompt") == len(prompts["short"])
    assert _counter(text, decisions, kind="remote", reason="slo-headroom") == 3
    assert _counter(text, "pdserve_router_pd_ttft_error_ratio_count", route="remote") == 3
    assert _counter(text, "pdserve_router_pd_ttft_error_ratio_count", route="local") == len(prompts["short"])
    sent = deployment.stats(deployment.prefill[0])
    received = deployment.stats(deployment.decode[0])
    assert sent.num_kv_transfers == 3 and received.num_kv_transfers == 3
    assert sent.kv_transfer_bytes == received.kv_transfer_bytes > 0
    _whole(deployment)


def _cancel_after_tokens(dep, tokens: list[int], n: int = 3) -> int:
    return dep.cancel_after_tokens(_request(tokens, max_tokens=400), n)


@pytest.mark.parametrize("path", ["local", "remote"])
def test_cancel_mid_stream_leaves_both_pools_whole(deployment, prompts, path):
    tokens = prompts["short"][0] if path == "local" else prompts["long"][3]   # not seen before: uncached
    before = deployment.stats(deployment.prefill[0]).num_kv_transfers
    kind_before = _counter(deployment.scrape("router"), "pdserve_router_pd_decisions_total", kind=path)
    assert _cancel_after_tokens(deployment, tokens) >= 3
    assert _counter(deployment.scrape("router"), "pdserve_router_pd_decisions_total", kind=path) == kind_before + 1
    _whole(deployment)
    sent = deployment.stats(deployment.prefill[0]).num_kv_transfers
    assert sent == before + (path == "remote")
