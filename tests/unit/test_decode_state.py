"""The decode worker's request states on a real engine: lease expiry, cancel during a receive,
admission of imported KV, deadlines. Every path leaves the block pool whole."""
from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.broadcast import Broadcast
from pdserve.decode_worker.state import DecodeState, NoSuchRequest


class Outputs(Broadcast):
    """Records what would go to the router streams."""

    def __init__(self) -> None:
        super().__init__(asyncio.new_event_loop())
        self.items = []

    def publish(self, key, item) -> bool:
        self.items.append((key, item))
        return True


@pytest.fixture()
def env():
    engine = LLMEngine(EngineConfig(model="tiny-qwen3", device="cpu", num_kv_blocks=32, block_size=16))
    outputs = Outputs()
    return engine, DecodeState(outputs, default_lease_ms=50), outputs


PROMPT = list(range(3, 40))
PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_lease_expiry_frees_the_reservation(env):
    engine, state, outputs = env
    blocks, cached = state.reserve(engine, "r1", PROMPT, PARAMS, 1, None, "router")
    assert len(blocks) == 3 and cached == 0 and engine.block_manager.num_used_blocks == 3
    time.sleep(0.01)
    state.expire(engine)
    assert engine.block_manager.is_whole() and "r1" not in state.tracked
    (router, [update]), = outputs.items
    assert router == "router" and update.finish_reason == FinishReason.ERROR and "lease" in update.error


def test_receive_then_admit_then_decode_to_the_end(env):
    engine, state, outputs = env
    blocks, _ = state.reserve(engine, "r1", PROMPT, PARAMS, 0, None, "router")
    with pytest.raises(ValueError):
        state.start_receive(engine, "r1", blocks[:1])          # must match the reservation
    state.start_receive(engine, "r1", blocks)
    state.expire(engine)                                      # a receiving request has no lease
    assert "r1" in state.tracked
    state.finish_receive(engine, "r1", 7, 0.0, None, None, num_bytes=123)
    assert state.num_transfers == 1 and state.transfer_bytes == 123
    while engine.has_unfinished():
        state.on_step(engine.step())
    tokens = [t for _, updates in outputs.items for u in updates for t in u.token_ids]
    assert len(tokens) == PARAMS.max_tokens - 1                # the first token came from the prefill side
    assert outputs.items[-1][1][0].finish_reason == FinishReason.LENGTH
    assert engine.block_manager.is_whole()


def test_cancel_during_receive_frees_blocks_when_the_receive_ends(env):
    engine, state, outputs = env
    blocks, _ = state.reserve(engine, "r1", PROMPT, PARAMS, 0, None, "router")
    state.start_receive(engine, "r1", blocks)
    assert state.cancel(engine, "r1")
    assert engine.block_manager.num_used_blocks == 3           # the sender may still write them
    state.finish_receive(engine, "r1", 7, 0.0, None, None)
    assert engine.block_manager.is_whole()
    assert outputs.items[-1][1][0].finish_reason == FinishReason.CANCELLED
    with pytest.raises(NoSuchRequest):
        state.start_receive(engine, "r1", blocks)


def test_deadline_and_router_departure(env):
    engine, state, outputs = env
    state.submit(engine, "a", PROMPT, PARAMS, time.time() - 1, "router")
    state.submit(engine, "b", PROMPT, SamplingParams(max_tokens=50), None, "other")
    state.expire(engine)
    assert outputs.items[-1][1][0].finish_reason == FinishReason.DEADLINE
    assert state.cancel_router(engine, "other") == 1
    assert not engine.has_unfinished() and engine.block_manager.is_whole()


def _ends(outputs) -> dict[int, list]:
    """Per sample index, the finish reasons published."""
    ends: dict[int, list] = {}
    for _, items in outputs.items:
        for u in (items if isinstance(items, list) else [items]):
            if u.finish_reason is not None:
                ends.setdefault(u.index, []).append(u.finish_reason)
    return ends


def test_n_samples_each_end_once_even_in_one_step(env):
    """Imported KV of an n = 3 request: the samples fork on admit and end in the same step (same
    length); each gets exactly one last output, and the request is forgotten after the last."""
    engine, state, outputs = env
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True, n=3)
    blocks, _ = state.reserve(engine, "r1", PROMPT, params, 0, None, "router")
    assert engine.block_manager.num_used_blocks == 3 + 2            # the forks' last blocks too
    state.start_receive(engine, "r1", blocks)
    state.finish_receive(engine, "r1", 7, 0.0, None, None)
    tokens: dict[int, int] = {}
    while engine.has_unfinished():
        out = engine.step()
        state.on_step(out)
        for seq in out.seqs:
            tokens[seq.index] = tokens.get(seq.index, 0) + 1
    assert tokens == {0: 3, 1: 4, 2: 4}            # sample 0's first token came with the KV
    assert _ends(outputs) == {i: [FinishReason.LENGTH] for i in range(3)}
    assert "r1" not in state.tracked and engine.block_manager.is_whole()


def test_cancel_of_an_n_request_ends_every_sample(env):
    engine, state, outputs = env
    state.submit(engine, "r1", PROMPT, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, n=3), None,
                 "router")
    for _ in range(3):
        state.on_step(engine.step())
    assert state.cancel(engine, "r1")
    assert _ends(outputs) == {i: [FinishReason.CANCELLED] for i in range(3)}
    assert "r1" not in state.tracked and engine.block_manager.is_whole()
