"""The worker shell's parts: a Deferred servicer on a real grpc.aio server (UNAVAILABLE while
loading, then every rpc kind forwarded), engine hooks of role both, the handoff phases."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.grpc_utils import Service, build_server, client_channel
from pdserve.common.grpc_utils.deferred import Deferred
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.serving.engine_loop import EngineHooks
from pdserve.decode_worker.state import Phase, Tracked
from pdserve.v1 import worker_pb2, worker_pb2_grpc

WORKER = worker_pb2.DESCRIPTOR.services_by_name["Worker"]


class Loaded(worker_pb2_grpc.WorkerServicer):
    """What the worker serves once loaded: one unary and one server-streaming rpc."""

    async def Cancel(self, request: Any, context: Any) -> worker_pb2.CancelResponse:
        return worker_pb2.CancelResponse(found=request.request_id == "r1")

    async def StreamKvEvents(self, request: Any, context: Any):
        for seq in (1, 2, 3):
            yield worker_pb2.KvEvents(worker_id="w0", seq=seq)


def test_deferred_answers_unavailable_until_bound_then_forwards() -> None:
    async def main() -> None:
        gate = Deferred(WORKER, "worker w0 is still loading its model")
        server = build_server("127.0.0.1:0", [Service(WORKER, worker_pb2_grpc.add_WorkerServicer_to_server, gate)])
        await server.start()
        try:
            async with client_channel(f"127.0.0.1:{server.port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                for call in (lambda: stub.Cancel(worker_pb2.CancelRequest(request_id="r1"), timeout=5),
                             lambda: _collect(stub.StreamKvEvents(worker_pb2.KvEventsRequest(), timeout=5))):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call()
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert "still loading its model" in (e.value.details() or "")
                gate.bind(Loaded())
                assert (await stub.Cancel(worker_pb2.CancelRequest(request_id="r1"), timeout=5)).found
                assert not (await stub.Cancel(worker_pb2.CancelRequest(request_id="r2"), timeout=5)).found
                events = await _collect(stub.StreamKvEvents(worker_pb2.KvEventsRequest(), timeout=5))
                assert [e.seq for e in events] == [1, 2, 3]
                with pytest.raises(grpc.aio.AioRpcError) as e:   # not served by this servicer
                    await stub.Reserve(worker_pb2.ReserveRequest(request_id="r3"), timeout=5)
                assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        finally:
            await server.stop_now()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


async def _collect(call: Any) -> list:
    return [msg async for msg in call]


def test_combined_hooks_run_both_roles_in_order() -> None:
    calls: list[str] = []
    decode = EngineHooks(lambda out: calls.append("decode.step"), lambda e: calls.append("decode.expire"))
    prefill = EngineHooks(lambda out: calls.append("prefill.step"), lambda e: calls.append("prefill.expire"),
                          lambda seqs, launched: calls.append("prefill.launch"))
    both = EngineHooks.combine(decode, prefill)
    both.before_step(None)  # type: ignore[arg-type]
    both.on_step(StepOutput(is_prefill=False))
    assert both.on_prefill_launch is not None
    both.on_prefill_launch([], None)  # type: ignore[arg-type]
    assert calls == ["decode.expire", "prefill.expire", "decode.step", "prefill.step", "prefill.launch"]
    assert EngineHooks.combine(decode, decode).on_prefill_launch is None


def test_decode_handoff_moves_only_forward_one_phase_at_a_time() -> None:
    engine = LLMEngine(EngineConfig(model="tiny-qwen3", device="cpu", num_kv_blocks=8, block_size=16))
    seq = engine.kv_handoff.reserve(list(range(3, 20)), SamplingParams(max_tokens=2), "r1")
    t = Tracked(seq, "router", None, None, Phase.RESERVED)
    with pytest.raises(RuntimeError, match="reserved -> active"):
        t.advance(Phase.ACTIVE)
    t.advance(Phase.RECEIVING)
    with pytest.raises(RuntimeError, match="receiving -> receiving"):
        t.advance(Phase.RECEIVING)
    t.advance(Phase.ACTIVE)
    with pytest.raises(RuntimeError, match="active -> reserved"):
        t.advance(Phase.RESERVED)
    engine.abort("r1")
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
