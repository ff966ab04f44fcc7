"""What every worker process has: the engine and its thread, KV events, identity, metrics, and
the ids cancelled here (:class:`~pdserve.common.serving.cancels.Tombstones`)."""
from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.common.config import EngineConfig, dtype_name
from pdserve.common.engine.llm_engine import LLMEngine, StepOutput
from pdserve.common.engine.ranks import exit_on_rank_failure, register_rank_extension
from pdserve.common.grpc_utils.protocol import PROTOCOL_VERSION
from pdserve.common.kv_transfer.layout import KvLayout, model_block_bytes
from pdserve.common.serving.broadcast import Broadcast
from pdserve.common.serving.cancels import Tombstones
from pdserve.common.serving.engine_loop import EngineHooks, EngineLoop
from pdserve.common.serving.kv_events import KvEventLog
from pdserve.common.serving.metrics import RequestTracker, WorkerMetrics

logger = logging.getLogger(__name__)
T = TypeVar("T")
KV_RANK_AGENT = "pdserve.common.kv_transfer.rank_agent:RankKvAgent"   # a rank's share of KV transfers


class WorkerRuntime:
    """Built whole by :meth:`create` (the model loaded); :meth:`start` runs the engine thread
    with the role's hooks. Calls made in between wait for the thread."""

    def __init__(self, role: str, worker_id: str, engine_config: EngineConfig, engine: LLMEngine,
                 kv_log: KvEventLog) -> None:
        self.role = role
        self.worker_id = worker_id
        self.engine_config = engine_config
        self.engine = engine
        self.kv_log = kv_log
        self.aio_loop = asyncio.get_running_loop()
        self.outputs = Broadcast(self.aio_loop)      # per router: its requests' SequenceOutputs
        self.metrics = WorkerMetrics(role)
        self.requests = RequestTracker(self.metrics)  # per-request times (engine thread)
        self.loop = EngineLoop(engine, self.metrics.observe_step)
        self.cancelled = Tombstones()
        # ``call_now`` when the engine's state lock is taken: one thread, so such calls keep
        # their order, and none waits behind the pool that KV sends use (asyncio.to_thread)
        self._state_thread = ThreadPoolExecutor(1, thread_name_prefix="engine-state")
        self._queued_now = 0

    @classmethod
    async def create(cls, role: str, worker_id: str, engine_config: EngineConfig) -> WorkerRuntime:
        """Load the model (off the event loop) and build the runtime around it."""
        kv_log = KvEventLog(asyncio.get_running_loop())
        exit_on_rank_failure()          # a tensor-parallel rank's death ends this worker
        register_rank_extension(KV_RANK_AGENT)   # each rank ships / receives its own KV heads
        engine = await asyncio.to_thread(LLMEngine, engine_config, None, kv_log.record)
        logger.info("%s worker %s loaded %s: %d KV blocks of %d tokens", role, worker_id,
                    engine.source.config.name, engine.block_manager.num_blocks, engine_config.block_size)
        return cls(role, worker_id, engine_config, engine, kv_log)

    def start(self, hooks: EngineHooks) -> None:
        """Start the engine thread; request tracking and KV events ride along with ``hooks``."""
        def on_step(out: StepOutput) -> None:
            hooks.on_step(out)
            self.requests.on_step(out)
            self.kv_log.flush()

        def before_step(engine: LLMEngine) -> None:
            hooks.before_step(engine)
            self.kv_log.flush()

        self.loop.start(EngineHooks(on_step, before_step, hooks.on_prefill_launch))

    def stop(self) -> None:
        self.loop.stop()
        self.engine.close()             # a tensor-parallel engine's other ranks
        self._state_thread.shutdown(wait=False)
        self.outputs.close_all()
        self.kv_log.subscribers.close_all()

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))

    async def call_now(self, fn: Callable[[LLMEngine], T], *, shielded: bool = False) -> T:
        """Run ``fn(engine)`` under the engine's state lock, off the engine thread's step
        (``EngineLoop.now``): here at once when the lock is free (the engine idles or computes),
        else on the state thread as soon as it is. Never behind a long prefill step. If the
        caller is cancelled meanwhile, ``fn`` still runs once started (and, ``shielded``, also if
        it had not started): its effect never depends on the caller's rpc surviving."""
        if not self._queued_now:
            ran, result = self.loop.try_now(fn)
            if ran:
                return result       # type: ignore[return-value]
        self._queued_now += 1
        try:
            future = asyncio.wrap_future(self._state_thread.submit(contextvars.copy_context().run, self.loop.now, fn))
            return await (asyncio.shield(future) if shielded else future)
        finally:
            self._queued_now -= 1

    async def kv_snapshot(self) -> tuple[list[int], int, int]:
        """(hashes cached now, number of the last event batch they include, pool size), read
        on the engine thread, where events are flushed, so the number matches the hashes."""
        return await self.call(lambda engine: (list(engine.block_manager.hash_to_block_id), self.kv_log.seq,
                                               engine.block_manager.num_blocks))

    def info(self) -> dict:
        e = self.engine
        return {"protocol_version": PROTOCOL_VERSION, "model": e.source.config.name,
                "dtype": str(e.model_runner.dtype).replace("torch.", ""), "block_size": e.config.block_size,
                "max_model_len": e.max_model_len, "num_kv_blocks": e.block_manager.num_blocks,
                "worker_id": self.worker_id, "vocab_size": e.source.config.vocab_size,
                "kv_cache_dtype": dtype_name(e.model_runner.kv_cache_dtype),
                "tensor_parallel_size": e.config.tensor_parallel_size,
                "num_kv_heads": e.source.config.num_key_value_heads, "head_dim": e.source.config.head_dim}

    def kv_layout(self) -> KvLayout:
        """This worker's KV layout, as peers that exchange KV with it see it."""
        e, c = self.engine, self.engine.source.config
        return KvLayout(e.config.tensor_parallel_size, c.num_key_value_heads, c.head_dim,
                        dtype_name(e.model_runner.kv_cache_dtype))

    def model_block_bytes(self) -> int:
        """Bytes of one KV block over every KV head of the model (PushKV.num_bytes per block)."""
        runner = self.engine.model_runner
        return model_block_bytes(runner.block_bytes, runner.model.num_local_kv_heads,
                                 self.engine.source.config.num_key_value_heads)

    def stats(self, num_reserved: int) -> dict:
        """The engine's counters as of its last step (never waits for the engine thread)."""
        return {**self.loop.stats, "num_reserved": num_reserved,
                "tensor_parallel_size": self.engine_config.tensor_parallel_size}
