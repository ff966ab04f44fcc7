"""The fleet as users start it: ``pdserve up`` with two workers of role both and the router's
default policy (``fleet``), the workers at a step budget with a smaller one beside decode rows
(``--max-mixed-batched-tokens``, as ``pdserve up --gpus`` starts them on GPUs, scaled to the CPU).
Concurrent greedy streams equal the offline engine's, each worker reports the mixed budget that
the router models, and streams cancelled while busy loops hold both cores leave both pools whole."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import deployment as services
from pdserve.common.engine import SamplingParams
from pdserve.v1 import common_pb2, router_pb2
from tests.integration.cpu_load import CpuLoad

BUDGET, MIXED = 256, 64
SYSTEM = "You answer questions about lighthouses, their keepers, lenses and foghorns, in one short sentence. " * 5
QUESTIONS = ["What is a Fresnel lens?", "Who kept the lights?", "Why are foghorns low?", "How tall are they?"]


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    d = services.start_up(tmp_path_factory.mktemp("fleet-up"), [
        "--prefill", "0", "--decode", "2", "--role", "both",
        f"--extra-decode-args=--max-num-seqs 16 --max-num-batched-tokens {BUDGET} --max-mixed-batched-tokens {MIXED}",
        "--extra-router-args=--admission-slo-multiple 0"], num_prefill=0, num_decode=2, decode_role="both")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def prompts(offline) -> list[list[int]]:
    return [offline.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
            for q in QUESTIONS]


def _request(tokens: list[int], max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens),
                                      params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens))


def test_concurrent_streams_equal_offline_and_the_mixed_budget_is_reported(dep, offline, prompts):
    assert all(len(p) > MIXED for p in prompts)        # every prompt is cut into chunks of both sizes
    want = [o.token_ids for o in offline.generate(prompts, SamplingParams(temperature=0, max_tokens=12),
                                                  use_tqdm=False)]
    stub = dep.router_stub()

    def stream(tokens: list[int]) -> list[int]:
        return [t for msg in stub.Generate(_request(tokens, 12), timeout=180) for t in msg.token_ids]

    with ThreadPoolExecutor(len(prompts)) as pool:
        assert list(pool.map(stream, prompts)) == want
    for w in dep.decode:
        assert dep.stats(w).max_num_batched_tokens == MIXED     # a step with decode rows: what the router models
        dep.wait_whole(w)


def test_cancels_with_the_cpu_loaded_leave_both_pools_whole(dep, prompts):
    load = CpuLoad(60.0)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            seen = list(pool.map(lambda p: dep.cancel_after_tokens(_request(p, 300), 3), prompts))
    finally:
        load.stop()
    assert all(n >= 3 for n in seen)
    for w in dep.decode:
        dep.wait_whole(w)
