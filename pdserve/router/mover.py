"""Decodes that move (``--pd-policy fleet``, every ``--pd-move-interval-s``): the workers' snapshots
go through :func:`pdserve.router.fleet_policy.pick_moves`; for each (source, destination, n) the
``n`` requests decoding on the source with the most tokens still to make are marked to go on at
the destination. :class:`~pdserve.router.flow.Flow` acts on the mark at the request's next step:
it closes the attempt on the source and continues the request from its prompt and the tokens
already sent, prefilled on the source (its prefix cache holds the request's full blocks, so only
the last partial block is computed) with the KV shipped into the destination's reservation, the
path of every remote prefill. The client's stream goes on; greedy output is the unmoved one's.

One owner: the mover keeps which requests are running (``track`` / ``untrack``), the flow keeps
each request's attempts. A request moves at most ``MAX_MOVES_PER_REQUEST`` times.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.router import fleet_policy

log = logging.getLogger(__name__)

MAX_MOVES_PER_REQUEST = 1


class Movable(Protocol):
    """A running request as the mover reads and marks it (the flow's per-request state)."""

    move_to: str | None             # set by the mover; the flow clears it when it acts
    moves: int

    @property
    def decode_key(self) -> str | None: ...     # the worker decoding it now; None between attempts
    @property
    def tokens_left(self) -> int: ...


@dataclass
class Mover:
    """``snapshots()``: the fleet's workers now (fleet_policy.FleetWorker, ``uncached_tokens`` 0)."""

    snapshots: Callable[[], Sequence[fleet_policy.FleetWorker]]
    slo_tpot_ms: float
    interval_s: float
    window_s: float = 2.0           # the router's --pd-rate-window-s (fleet_policy.dedicated_lean)
    running: set[Movable] = field(default_factory=set)
    _task: asyncio.Task | None = None

    def track(self, run: Movable) -> None:
        self.running.add(run)
        if self._task is None and self.interval_s > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def untrack(self, run: Movable) -> None:
        self.running.discard(run)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.round()
            except Exception:       # a bad round must not end the moves for good
                log.exception("decode moves: round failed")

    def round(self) -> int:
        """One round of moves: marks requests, returns how many."""
        if not self.running:
            return 0
        marked = 0
        for src, dst, n in fleet_policy.pick_moves(self.snapshots(), self.slo_tpot_ms, self.window_s):
            cands = [r for r in self.running if r.decode_key == src and r.move_to is None
                     and r.moves < MAX_MOVES_PER_REQUEST and r.tokens_left > 1]
            for run in sorted(cands, key=lambda r: -r.tokens_left)[:n]:
                run.move_to = dst
                marked += 1
        return marked
