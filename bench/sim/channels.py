"""The pair channels a simulated prefill worker would hold: the same closing rule as
``KvSender`` (pdserve/common/kv_transfer/channel_lru.py), counted, with no communicator behind it."""
from __future__ import annotations

import time

from pdserve.common.kv_transfer.channel_lru import channels_to_close


class ChannelBook:
    def __init__(self, max_open: int, idle_s: float) -> None:
        self.max_open = max_open
        self.idle_s = idle_s
        self.last_used: dict[str, float] = {}
        self.busy: dict[str, int] = {}
        self.num_opened = 0
        self.max_seen = 0

    def begin(self, peer: str, now: float | None = None) -> bool:
        """A transfer to ``peer`` starts; True when its channel had to be (re)opened."""
        now = time.monotonic() if now is None else now
        idle = self.last_used.get(peer)
        opened = idle is None or (self.idle_s > 0 and now - idle >= self.idle_s and not self.busy.get(peer))
        if opened:
            self.last_used.pop(peer, None)
            for k in channels_to_close(self.last_used, now, self.max_open, self.idle_s,
                                       {k for k, n in self.busy.items() if n}, opening=1):
                del self.last_used[k]
            self.num_opened += 1
        self.last_used[peer] = now
        self.busy[peer] = self.busy.get(peer, 0) + 1
        self.max_seen = max(self.max_seen, len(self.last_used))
        return opened

    def end(self, peer: str, now: float | None = None) -> None:
        self.busy[peer] = max(0, self.busy.get(peer, 0) - 1)
        if peer in self.last_used:
            self.last_used[peer] = time.monotonic() if now is None else now

    @property
    def num_open(self) -> int:
        return len(self.last_used)
