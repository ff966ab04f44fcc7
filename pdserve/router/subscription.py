"""One ``Subscribe`` stream per decode worker: its StepOutputs are fanned out to the requests.

Each request in flight on the worker has an :class:`OutputBuffer` (a list and at most one waiter);
outputs for unknown ids are dropped, and a request takes everything buffered at once. When the
stream breaks or ends every buffer gets :class:`~pdserve.common.grpc_utils.Unavailable` and
``on_broken`` tells the worker's client. Event loop thread only.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc
import grpc.aio

from pdserve.common.grpc_utils import Unavailable
from pdserve.common.grpc_utils.convert import sequence_output_from_proto
from pdserve.router.settings import SUBSCRIBE_CONFIRM_S, SUBSCRIBE_WINDOW_BYTES

log = logging.getLogger(__name__)

# The Subscribe stream has a connection of its own with a fixed, small HTTP/2 window (no BDP
# probing, which would grow it to megabytes): when the router reads slower than the worker
# steps, at most SUBSCRIBE_WINDOW_BYTES of outputs wait in the router, and the rest waits in the
# worker, which merges the queued steps into one StepOutputs (one SequenceOutput per request).
# So a router that falls behind gets fewer, larger messages instead of a growing backlog of
# one-token ones; control rpcs (Submit, Reserve, ...) never queue behind that stream.
SUBSCRIBE_CHANNEL_OPTIONS = (
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", SUBSCRIBE_WINDOW_BYTES),
    ("grpc.use_local_subchannel_pool", 1),
)


class OutputBuffer:
    """What the Subscribe reader has for one request and the request has not taken yet.

    The API is a subset of ``asyncio.Queue``'s (``put_nowait``, ``get``, ``get_nowait``,
    ``empty``) plus :meth:`take_all` and :meth:`wait`: one list and one future per wait, no
    per-item wake-up. ``on_put`` (optional) sees every item as it is added.
    """

    __slots__ = ("items", "_waiter", "on_put")

    def __init__(self) -> None:
        self.items: list = []
        self._waiter: asyncio.Future | None = None
        self.on_put: Callable[[object], None] | None = None

    def put_nowait(self, item) -> None:
        self.items.append(item)
        if self.on_put is not None:
            self.on_put(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def empty(self) -> bool:
        return not self.items

    def qsize(self) -> int:
        return len(self.items)

    async def wait(self) -> None:
        """Return once something is buffered."""
        while not self.items:
            w = self._waiter
            if w is None or w.done():     # done: a waiter that was cancelled
                w = self._waiter = asyncio.get_running_loop().create_future()
            await w

    def take_all(self) -> list:
        items, self.items = self.items, []
        return items

    def get_nowait(self):
        if not self.items:
            raise asyncio.QueueEmpty
        return self.items.pop(0)

    async def get(self):
        await self.wait()
        return self.items.pop(0)


class Subscription:
    """``open_stream`` starts the worker's Subscribe call (see pdserve.router.worker_client)."""

    def __init__(self, key: str, open_stream: Callable[[], grpc.aio.UnaryStreamCall],
                 on_broken: Callable[[str], None]) -> None:
        self.key = key
        self.open_stream = open_stream
        self.on_broken = on_broken
        self.open = False
        self._queues: dict[str, OutputBuffer] = {}
        self._call: grpc.aio.UnaryStreamCall | None = None
        self._task: asyncio.Task | None = None
        self.num_messages = 0

    async def start(self, confirm_s: float = SUBSCRIBE_CONFIRM_S) -> None:
        """Open the stream; returns once the worker sent its headers (or after ``confirm_s``).

        Raises :class:`Unavailable` when the stream fails at once.
        """
        call = self.open_stream()
        headers = asyncio.ensure_future(call.initial_metadata())
        await asyncio.wait({headers}, timeout=confirm_s)
        if call.done():
            code = await call.code()
            details = await call.details()
            raise Unavailable(f"Subscribe on {self.key} failed: {code.name}: {details}")
        if not headers.done():
            headers.cancel()
            log.debug("Subscribe on %s: no headers within %.1f s; assuming it is open", self.key, confirm_s)
        self._call = call
        self.open = True
        self._task = asyncio.create_task(self._read(call), name=f"subscribe-{self.key}")

    async def _read(self, call: grpc.aio.UnaryStreamCall) -> None:
        reason = "stream ended"
        try:
            queues = self._queues
            async for msg in call:
                self.num_messages += 1
                for out in msg.outputs:
                    queue = queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(sequence_output_from_proto(out))
                    elif log.isEnabledFor(logging.DEBUG):
                        log.debug("%s: output for unknown request %s", self.key, out.request_id)
                queues = self._queues       # _fail_all may have replaced it
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except Exception as e:  # noqa: BLE001 - never leave requests hanging
            log.exception("Subscribe reader of %s failed", self.key)
            reason = f"{type(e).__name__}: {e}"
        if self.open:
            self._fail_all(reason)
            self.on_broken(f"output stream broke ({reason})")

    def _fail_all(self, reason: str) -> None:
        self.open = False
        queues, self._queues = self._queues, {}
        for queue in queues.values():
            queue.put_nowait(Unavailable(f"decode worker {self.key}: output stream broke ({reason})"))

    def register(self, request_id: str) -> OutputBuffer:
        """The buffer that receives ``request_id``'s outputs (before Reserve / Submit)."""
        if not self.open:
            raise Unavailable(f"decode worker {self.key}: output stream is not open")
        queue = OutputBuffer()
        self._queues[request_id] = queue
        return queue

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def num_requests(self) -> int:
        return len(self._queues)

    def close(self, reason: str = "closed") -> None:
        """Stop reading; pending requests get UNAVAILABLE."""
        if self.open:
            self._fail_all(reason)
        if self._call is not None:
            self._call.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
