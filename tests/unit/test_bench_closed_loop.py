"""Closed-loop multi-turn load (``pdserve bench serve --closed-loop-turns``): a conversation's next
turn is sent only once its previous turn has ended. The client runs against a real gRPC
Generation server (in a thread of its own) that answers each request after a fixed time."""
from __future__ import annotations

import asyncio

import pytest
from generation_server import serve

from pdserve.loadtest import datasets
from pdserve.loadtest.client import _shares, run_load
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

HOLD_S = 0.3


class SlowGeneration(router_pb2_grpc.GenerationServicer):
    """Streams two tokens, the second ``HOLD_S`` after the request arrived."""

    async def Generate(self, request, context):
        yield router_pb2.GenerateResponse(token_ids=[1])
        await asyncio.sleep(HOLD_S)
        yield router_pb2.GenerateResponse(token_ids=[2], finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.fixture(scope="module")
def server_address():
    with serve(SlowGeneration()) as address:
        yield address


def _conversations(turns: int = 3, conversations: int = 4) -> list[datasets.BenchRequest]:
    return datasets.multi_turn(turns * conversations, turns, 2, 16, (4, 8), (2, 2), 1000, seed=1, active=conversations)


def test_closed_loop_links_each_turn_to_its_conversations_previous_one() -> None:
    reqs = datasets.closed_loop(_conversations())
    for i, r in enumerate(reqs):
        if r.extra["turn"] == 0:
            assert r.after == -1
        else:
            prev = reqs[r.after]
            assert r.after < i and prev.extra == {"conversation": r.extra["conversation"], "turn": r.extra["turn"] - 1}
    with pytest.raises(ValueError, match="multi-turn"):
        datasets.closed_loop([datasets.BenchRequest(4, 2, token_ids=[1, 2, 3, 4])])


def test_shares_keep_a_conversation_in_one_process() -> None:
    reqs = datasets.closed_loop(_conversations())
    items = [(i, r, 0.0) for i, r in enumerate(reqs)]
    shares = _shares(items, 3)
    where = {idx: p for p, share in enumerate(shares) for idx, _, _ in share}
    assert sorted(where) == list(range(len(reqs)))
    for idx, r, _ in items:
        if r.after >= 0:
            assert where[idx] == where[r.after]
    open_loop = _shares([(i, datasets.BenchRequest(1, 1, token_ids=[1]), 0.0) for i in range(5)], 2)
    assert [[i for i, _, _ in s] for s in open_loop] == [[0, 2, 4], [1, 3]]
    with pytest.raises(ValueError, match="does not come before"):
        _shares([(0, datasets.BenchRequest(1, 1, token_ids=[1], after=1), 0.0)], 1)


@pytest.mark.parametrize("closed, procs", [(True, 1), (False, 1), (True, 2)])
def test_next_turn_waits_for_the_previous_one(server_address: str, closed: bool, procs: int) -> None:
    reqs = _conversations()
    if closed:
        reqs = datasets.closed_loop(reqs)
    res = run_load(server_address, reqs, [0.0] * len(reqs), timeout=30, channels_per_proc=2, num_procs=procs)
    assert all(r.code == "OK" for r in res.records)
    by_index = {r.index: r for r in res.records}
    turns = {(q.extra["conversation"], q.extra["turn"]): i for i, q in enumerate(reqs)}
    for (conv, turn), i in turns.items():
        if turn:
            prev = by_index[turns[(conv, turn - 1)]]
            if closed:     # sent after the previous turn ended; its wait is not send lag
                assert by_index[i].send_time >= prev.end_time
                assert by_index[i].scheduled_time >= prev.end_time
            else:          # every turn at its arrival (all at once here)
                assert by_index[i].send_time < prev.end_time
    assert res.client["num_procs"] == procs
    if closed:      # three turns one after another; waiting for a previous turn is not send lag (>= 2 HOLD_S)
        assert res.duration >= 3 * HOLD_S and res.client["max_send_lag_ms"] < 1000 * HOLD_S
