"""Decodes that move (``--pd-policy fleet``, pdserve/router/mover.py) as separate processes on the
CPU (embedded model, Gloo): two workers of role both; while the second is down, two long greedy
streams decode on the first; once the second is back, the first's decode step is over the TPOT
objective (set far below a CPU step) with two rows against none, so the mover sends one of them
over: it is prefilled again on the first worker (a prefix-cache hit on its own blocks), its KV
shipped to the second, and it decodes on there. Both streams end with the offline engine's tokens,
uninterrupted, and both pools end whole.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bench import deployment as services
from pdserve.common.engine import SamplingParams
from pdserve.v1 import common_pb2, router_pb2

MAX_TOKENS = 320
QUESTIONS = ["Tell me a long story about a lighthouse keeper.", "Explain how glaciers carve valleys, in detail."]


@pytest.fixture(scope="module")
def dep(tmp_path_factory):
    """Two role-both workers behind a router that moves decodes (TPOT objective 1 ms), for both
    tests: each kills the second worker and starts it again itself. Admission control is off: the
    decode steps an earlier test measured (seconds on a loaded CI machine) must not refuse the
    next test's streams."""
    d = services.start(tmp_path_factory.mktemp("fleet-moves"), decode_role="both", num_decode=2, num_prefill=0,
                       metrics=True, extra_worker_args=["--tpot-target-ms", "500"],
                       router_args=["--pd-policy", "fleet", "--slo-tpot-ms", "1", "--pd-move-interval-s", "0.3",
                                    "--admission-slo-multiple", "0"])
    yield d
    d.stop()


def _metric(dep, name: str, **labels: str) -> float:
    total = 0.0
    for line in dep.scrape("router").splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _moves(dep) -> float:
    return _metric(dep, "pdserve_router_pd_decisions_total", kind="remote", reason="move")


def _wait(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _first_worker_only(dep) -> None:
    """The second worker killed, once the router counts it gone: what is sent now decodes on the first."""
    dep.kill("decode1")
    _wait(lambda: _metric(dep, "pdserve_router_workers_up", role="ROLE_BOTH") == 1)


def _second_worker_back(dep) -> None:
    """Once both streams run on the first worker: the second started again (the mover's target)."""
    _wait(lambda: dep.stats(dep.decode[0]).num_running == 2)
    dep.restart("decode1")


def _stream(dep, tokens: list[int]) -> list[list[int]]:
    req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=tokens),
                                     params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                      ignore_eos=True))
    return [list(msg.token_ids) for msg in dep.router_stub().Generate(req, timeout=300)]


def test_a_decode_moves_to_the_idle_worker_and_its_output_is_unchanged(dep, offline):
    prompts = [offline.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [o.token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    moves = _moves(dep)
    _first_worker_only(dep)
    with ThreadPoolExecutor(2) as pool:
        streams = [pool.submit(_stream, dep, p) for p in prompts]
        _second_worker_back(dep)
        got = [f.result() for f in streams]
    assert [sum(msgs, []) for msgs in got] == expected
    assert _moves(dep) >= moves + 1
    moved = dep.stats(dep.decode[1])
    assert moved.num_kv_transfers >= 1 and moved.kv_transfer_bytes > 0
    for w in dep.decode:
        dep.wait_whole(w)


def test_cancelling_moved_decodes_leaves_both_pools_whole(dep):
    """The same move, then each stream cancelled by its client as soon as a decode has moved: the
    moved one (on the second worker now) and the one that stayed; both pools end whole."""
    prompts = [router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=list(range(100 + i, 160 + i))),
                                          params=common_pb2.SamplingParams(temperature=0, max_tokens=4000,
                                                                           ignore_eos=True))
               for i in range(2)]
    moves = _moves(dep)
    _first_worker_only(dep)
    calls = [dep.router_stub().Generate(p, timeout=300) for p in prompts]
    _second_worker_back(dep)
    _wait(lambda: _moves(dep) >= moves + 1, 120.0)
    _wait(lambda: dep.stats(dep.decode[1]).num_running == 1)       # the moved decode runs there
    for call in calls:
        call.cancel()
    for w in dep.decode:
        dep.wait_whole(w)
