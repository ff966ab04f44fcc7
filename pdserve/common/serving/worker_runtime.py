"""What every worker process has: the engine on its thread, KV events, identity and stats."""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from pdserve.common.config import EngineConfig
from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.grpc_utils.errors import Unavailable
from pdserve.common.grpc_utils.protocol import PROTOCOL_VERSION
from pdserve.common.serving.broadcast import Broadcast
from pdserve.common.serving.engine_loop import EngineLoop
from pdserve.common.serving.metrics import RequestTracker, WorkerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")


class WorkerRuntime:
    """Built inside the running asyncio loop; ``start()`` loads the model off the loop.

    The gRPC server (and so this object) is up while the model loads, so ``Info`` can answer
    UNAVAILABLE meanwhile: :attr:`engine` and :attr:`loop` raise :class:`Unavailable` until
    ``start()`` is done."""

    def __init__(self, role: str, worker_id: str, engine_config: EngineConfig) -> None:
        self.role = role
        self.worker_id = worker_id
        self.engine_config = engine_config
        self.aio_loop = asyncio.get_running_loop()
        self.kv_events = Broadcast(self.aio_loop)
        self.outputs = Broadcast(self.aio_loop)
        self._pending_events: list[tuple[str, int]] = []
        self._kv_seq = 0        # number of the last batch of KV events published (KvEvents.seq)
        self._events_lock = threading.Lock()
        self._engine: LLMEngine | None = None
        self._loop: EngineLoop | None = None
        self.metrics = WorkerMetrics(role)
        self.requests = RequestTracker(self.metrics)   # per-request times (engine thread)

    async def start(self, on_step: Callable[[StepOutput], None],
                    before_step: Callable[[LLMEngine], None] | None = None,
                    on_prefill_launch: Callable | None = None) -> None:
        """Build the engine and start its thread. ``on_prefill_launch``: the engine's hook
        after each prefill step is launched (``LLMEngine.on_prefill_launch``)."""
        engine = await asyncio.to_thread(LLMEngine, self.engine_config, None, self._on_kv_event)
        engine.on_prefill_launch = on_prefill_launch

        def step_hook(out: StepOutput) -> None:
            on_step(out)
            self.requests.on_step(out)
            self.flush_kv_events()

        def before() -> None:
            if before_step is not None:
                before_step(engine)
            self.flush_kv_events()

        loop = EngineLoop(engine, step_hook, before, self.metrics.observe_step)
        loop.start()
        self._engine, self._loop = engine, loop
        logger.info("%s worker %s ready: %s, %d KV blocks of %d tokens", self.role, self.worker_id,
                    engine.source.config.name, engine.block_manager.num_blocks, self.engine_config.block_size)

    @property
    def engine(self) -> LLMEngine:
        """The loaded engine; :class:`Unavailable` while the model loads."""
        if self._engine is None:
            raise self._loading()
        return self._engine

    @property
    def loop(self) -> EngineLoop:
        """The engine thread; :class:`Unavailable` while the model loads."""
        if self._loop is None:
            raise self._loading()
        return self._loop

    def _loading(self) -> Unavailable:
        return Unavailable(f"worker {self.worker_id} is still loading its model")

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.stop()
        self.outputs.close_all()
        self.kv_events.close_all()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))

    # ---- KV events (engine thread -> subscribers, batched per step) ----------------------
    def _on_kv_event(self, kind: str, block_hash: int) -> None:
        with self._events_lock:
            self._pending_events.append((kind, block_hash))

    def flush_kv_events(self) -> None:
        with self._events_lock:
            events, self._pending_events = self._pending_events, []
        if events:
            stored = [h for k, h in events if k == "stored"]
            evicted = [h for k, h in events if k == "evicted"]
            self._kv_seq += 1
            self.kv_events.publish_all((stored, evicted, self._kv_seq))

    async def kv_snapshot(self) -> tuple[list[int], int, int]:
        """(hashes cached now, number of the last event batch they include, pool size), read
        on the engine thread (where events are flushed, so the number matches the hashes)."""
        return await self.call(lambda engine: (list(engine.block_manager.hash_to_block_id), self._kv_seq,
                                               engine.block_manager.num_blocks))

    # ---- identity and stats ---------------------------------------------------------------
    def info(self) -> dict:
        e = self.engine
        return {"protocol_version": PROTOCOL_VERSION, "model": e.source.config.name,
                "dtype": str(e.model_runner.dtype).replace("torch.", ""), "block_size": e.config.block_size,
                "max_model_len": e.max_model_len, "num_kv_blocks": e.block_manager.num_blocks,
                "worker_id": self.worker_id, "vocab_size": e.source.config.vocab_size}

    def stats(self, num_reserved: Callable[[], int]) -> dict:
        """The engine's counters as of its last step (never waits for the engine thread)."""
        return {**self.loop.stats, "num_reserved": num_reserved()}
