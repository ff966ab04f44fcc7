"""A simulated prefill worker's GPU: prompts wait FIFO and run in batches (bench.sim.cost)."""
from __future__ import annotations

import asyncio
from collections import deque

from bench.sim.cost import CostModel, take_batch


class PrefillGpu:
    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.queue: deque[tuple[int, asyncio.Future]] = deque()
        self.running_tokens = 0
        self._wake = asyncio.Event()

    def submit(self, new_tokens: int) -> asyncio.Future:
        """A future that resolves when the prompt's ``new_tokens`` have been computed."""
        fut = asyncio.get_running_loop().create_future()
        self.queue.append((max(1, new_tokens), fut))
        self._wake.set()
        return fut

    def waiting_tokens(self) -> int:
        """Prompt tokens queued or being computed (WorkerStats.num_waiting_prefill_tokens)."""
        return self.running_tokens + sum(t for t, f in self.queue if not f.done())

    async def run(self) -> None:
        while True:
            while self.queue and self.queue[0][1].done():     # cancelled while queued
                self.queue.popleft()
            if not self.queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            live = [(t, f) for t, f in self.queue if not f.done()]
            n = take_batch([t for t, _ in live], self.cost.max_batched_tokens)
            batch = live[:n]
            taken = {id(f) for _, f in batch}
            self.queue = deque(x for x in self.queue if id(x[1]) not in taken and not x[1].done())
            self.running_tokens = sum(t for t, _ in batch)
            await asyncio.sleep(self.cost.prefill_ms(self.running_tokens) / 1000.0)
            self.running_tokens = 0
            for _, f in batch:
                if not f.done():
                    f.set_result(None)
