"""A worker's KV events: block hashes stored in and evicted from its prefix cache, batched per
step and numbered, for every ``StreamKvEvents`` subscriber (the routers' prefix indexes).

``record`` runs on the engine thread (the block manager's callback); ``flush`` publishes what
was recorded as one batch numbered ``seq`` (1, 2, ...), also on the engine thread, so a snapshot
read there matches the number of the last batch it includes.
"""
from __future__ import annotations

import asyncio
import threading

from pdserve.common.serving.broadcast import Broadcast

STORED, EVICTED = "stored", "evicted"


class KvEventLog:
    def __init__(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self.subscribers = Broadcast(aio_loop)
        self.seq = 0                     # number of the last batch published
        self._pending: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def record(self, kind: str, block_hash: int) -> None:
        with self._lock:
            self._pending.append((kind, block_hash))

    def flush(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        if events:
            stored = [h for k, h in events if k == STORED]
            evicted = [h for k, h in events if k == EVICTED]
            self.seq += 1
            self.subscribers.publish_all((stored, evicted, self.seq))
