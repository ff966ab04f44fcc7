"""Which pair channels of one worker to close: bookkeeping only (no torch).

Channels not ``busy`` and idle for ``idle_s`` seconds close; then, while ``opening`` more would
exceed ``max_open``, the least recently used non-busy ones close (all busy: open anyway, a
transfer never waits for another pair's). ``max_open``/``idle_s`` <= 0: no cap / no idle close.
"""
from __future__ import annotations

from collections.abc import Collection, Hashable, Mapping
from typing import TypeVar

K = TypeVar("K", bound=Hashable)


def channels_to_close(last_used: Mapping[K, float], now: float, max_open: int, idle_s: float,
                      busy: Collection[K] = (), opening: int = 0) -> list[K]:
    """The keys of the open channels to close now, least recently used first (see above)."""
    order = sorted((t, k) for k, t in last_used.items() if k not in busy)
    close = [k for t, k in order if idle_s > 0 and now - t >= idle_s]
    if max_open > 0:
        left = [k for _, k in order if k not in set(close)]
        excess = len(last_used) - len(close) + opening - max_open
        close += left[:max(0, excess)]
    return close
