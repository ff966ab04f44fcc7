"""Thread-safe fan-out from the engine thread to asyncio consumers (one queue per subscriber)."""
from __future__ import annotations

import asyncio
import threading
from typing import Any


class Broadcast:
    """``publish(key, item)`` from any thread; ``subscribe(key)`` gives an asyncio.Queue.

    A key has at most one subscriber: a new subscription replaces (and closes, with a None
    sentinel) the previous one. ``publish_all`` reaches every subscriber.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._queues: dict[str, asyncio.Queue] = {}
        self._lock = threading.Lock()

    def subscribe(self, key: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            old = self._queues.get(key)
            self._queues[key] = queue
        if old is not None:
            old.put_nowait(None)
        return queue

    def unsubscribe(self, key: str, queue: asyncio.Queue) -> bool:
        """Drop ``queue`` if it is still the subscription of ``key``; True if it was."""
        with self._lock:
            if self._queues.get(key) is queue:
                del self._queues[key]
                return True
        return False

    def has(self, key: str) -> bool:
        with self._lock:
            return key in self._queues

    def publish(self, key: str, item: Any) -> bool:
        with self._lock:
            queue = self._queues.get(key)
        if queue is None:
            return False
        self.loop.call_soon_threadsafe(queue.put_nowait, item)
        return True

    def publish_all(self, item: Any) -> None:
        with self._lock:
            queues = list(self._queues.values())
        for queue in queues:
            self.loop.call_soon_threadsafe(queue.put_nowait, item)

    def close_all(self) -> None:
        self.publish_all(None)
