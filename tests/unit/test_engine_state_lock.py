"""The engine's state lock on a real engine: calls off the engine thread (``EngineLoop.now``)
run while a step computes, not behind it; what they may do then (a reservation, a cancel of a
reserved or queued request, a lease renewal) takes effect at once, and a cancel of a request the
step computes frees its blocks right after that step. A Cancel that overtakes its request wins."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine
from pdserve.common.outputs import FinishReason
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.broadcast import Broadcast
from pdserve.common.serving.cancels import Tombstones
from pdserve.common.serving.engine_loop import EngineHooks, EngineLoop
from pdserve.decode_worker.state import CancelledBefore, DecodeState

PROMPT = list(range(3, 40))            # 3 blocks of 16
OTHER = list(range(100, 120))          # 2 blocks, no prefix in common with PROMPT
PARAMS = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


class Outputs(Broadcast):
    def __init__(self) -> None:
        super().__init__(asyncio.new_event_loop())
        self.items: list = []
        self.lock = threading.Lock()

    def publish(self, key, item) -> bool:
        with self.lock:
            self.items.append((key, item))
        return True

    def final(self, request_id: str):
        with self.lock:
            return [u for _, updates in self.items for u in updates
                    if u.request_id == request_id and u.finish_reason is not None]


@pytest.fixture()
def running():
    """An engine loop whose model computes only while ``gate`` is set (a step held open)."""
    engine = LLMEngine(EngineConfig(model="tiny-qwen3", device="cpu", num_kv_blocks=32, block_size=16))
    gate, computing = threading.Event(), threading.Event()
    launch = engine.model_runner.launch

    def slow_launch(*args, **kwargs):
        computing.set()
        gate.wait(10)
        computing.clear()
        return launch(*args, **kwargs)

    engine.model_runner.launch = slow_launch          # type: ignore[method-assign]
    loop = EngineLoop(engine)
    outputs = Outputs()
    state = DecodeState(outputs, 60_000, loop=loop, cancelled=Tombstones())
    loop.start(EngineHooks(state.on_step, state.expire))
    yield engine, loop, state, outputs, gate, computing
    gate.set()
    loop.stop()


def test_calls_run_while_a_step_computes(running):
    engine, loop, state, outputs, gate, computing = running
    loop.now(lambda e: state.submit(e, "run", PROMPT, PARAMS, None, "router"))
    assert computing.wait(5)                          # its prefill step computes, held open
    started = time.monotonic()
    blocks, cached = loop.now(lambda e: state.reserve(e, "res", OTHER, PARAMS, 0, None, "router"))
    assert len(blocks) == 2 and cached == 0
    assert loop.now(lambda e: state.renew(e, "router", ["res", "gone"])) == ["gone"]
    assert loop.now(lambda e: state.renew(e, "other-router", ["res"])) == ["res"]
    loop.now(lambda e: state.submit(e, "queued", PROMPT, PARAMS, None, "router"))
    assert loop.now(lambda e: state.cancel(e, "res"))          # reserved: freed now
    assert loop.now(lambda e: state.cancel(e, "queued"))       # waiting for its prefill: freed now
    assert loop.now(lambda e: state.cancel(e, "run"))          # in the step: after it
    assert time.monotonic() - started < 1.0 and computing.is_set()
    assert engine.block_manager.num_used_blocks == 3           # only the computing request's
    assert loop.stats["num_used_blocks"] == 3 and state.num_reserved() == 0
    assert [u.finish_reason for u in outputs.final("res") + outputs.final("queued")] == [FinishReason.CANCELLED] * 2
    assert not outputs.final("run")
    gate.set()
    end = time.monotonic() + 5
    while not outputs.final("run") and time.monotonic() < end:
        time.sleep(0.01)
    assert [u.finish_reason for u in outputs.final("run")] == [FinishReason.CANCELLED]
    assert loop.now(lambda e: e.block_manager.is_whole())


def test_a_cancel_that_overtakes_its_request_wins(running):
    engine, loop, state, outputs, gate, computing = running
    gate.set()
    state.cancelled.add("late")                       # what the Cancel rpc does first
    assert not loop.now(lambda e: state.cancel(e, "late"))
    for admit in (lambda e: state.reserve(e, "late", PROMPT, PARAMS, 0, None, "router"),
                  lambda e: state.submit(e, "late", PROMPT, PARAMS, None, "router")):
        with pytest.raises(CancelledBefore):
            loop.now(admit)
    assert loop.now(lambda e: e.block_manager.is_whole() and not e.requests)


def test_lease_renewal_keeps_a_reservation_past_its_lease(running):
    engine, loop, state, outputs, gate, computing = running
    gate.set()
    loop.now(lambda e: state.reserve(e, "kept", PROMPT, PARAMS, 150, None, "router"))
    loop.now(lambda e: state.reserve(e, "left", OTHER, PARAMS, 150, None, "router"))
    for _ in range(6):                                # 0.3 s: twice the lease
        time.sleep(0.05)
        assert loop.now(lambda e: state.renew(e, "router", ["kept"])) == []
    assert "kept" in state.tracked and "left" not in state.tracked
    (left,) = outputs.final("left")
    assert left.finish_reason == FinishReason.ERROR and "reservation lease expired" in left.error
    assert loop.now(lambda e: state.cancel(e, "kept"))
    assert loop.now(lambda e: e.block_manager.is_whole())
