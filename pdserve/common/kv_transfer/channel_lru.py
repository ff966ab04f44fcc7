"""Which pair channels of one worker to close: bookkeeping only (no torch, unit-testable).

A pair channel holds a communicator on each side (on NCCL, GPU memory for its buffers; see
bench/pair_channel_memory.py for the figure), and a prefill worker in a deployment of P prefill
and D decode workers could hold one per decode worker. So each side bounds them:

* a channel unused for ``idle_s`` seconds is closed;
* when a new channel is about to be opened and ``max_open`` are open already, the least
  recently used channels that are not busy (a transfer in flight) are closed first, until the
  new one fits (if every open channel is busy the new one is opened anyway: a transfer never
  waits for another pair's);
* a closed channel is re-created at the pair's next transfer, with a new epoch (the sender owns
  the epochs; the receiver sees the higher epoch on PushKV and joins the new channel).

Formula: with ``open`` the channels open, ``idle(k) = now - last_used(k)``::

    close = {k not busy : idle(k) >= idle_s}
            + least recently used first, among the other channels not busy, while
              |open| - |close| + opening > max_open

``max_open`` 0 (or less) = no cap; ``idle_s`` 0 (or less) = never idle-closed.
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
