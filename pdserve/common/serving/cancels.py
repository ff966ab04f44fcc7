"""Request ids cancelled on this worker, remembered for a while (:class:`Tombstones`).

A Cancel can overtake the request it cancels: the router gives up on a Reserve, Submit or
Prefill in flight (its deadline, its client left) and sends Cancel at once, and the two rpcs
reach the worker's state in either order. Cancel records the id here before it looks for the
request; every admission checks this record under the engine's state lock (the same lock
Cancel's search holds), so whichever comes first, the request ends: found and ended by the
Cancel, or refused (CANCELLED) when it arrives. Ids are unique per try of a request (the
router never reuses one), so remembering them is safe.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

TOMBSTONE_TTL_S = 300.0       # longer than any rpc the Cancel can overtake is in flight
MAX_TOMBSTONES = 100_000      # ~10 MB at most


class Tombstones:
    def __init__(self, ttl_s: float = TOMBSTONE_TTL_S, max_ids: int = MAX_TOMBSTONES) -> None:
        self.ttl_s = ttl_s
        self.max_ids = max_ids
        self._ids: OrderedDict[str, float] = OrderedDict()    # id -> expiry (monotonic), oldest first
        self._lock = threading.Lock()

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._ids[request_id] = now + self.ttl_s
            self._ids.move_to_end(request_id)
            while self._ids and (len(self._ids) > self.max_ids or next(iter(self._ids.values())) <= now):
                self._ids.popitem(last=False)

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            expiry = self._ids.get(request_id)    # type: ignore[call-overload]
        return expiry is not None and expiry > time.monotonic()

    def __len__(self) -> int:
        return len(self._ids)
