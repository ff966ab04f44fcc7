"""The decode mover (pdserve/router/mover.py): which running requests a round marks, and the loop."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pdserve.router.fleet_policy import FleetWorker
from pdserve.router.mover import MAX_MOVES_PER_REQUEST, Mover


@dataclass(eq=False)
class Run:
    decode_key: str | None
    tokens_left: int
    move_to: str | None = None
    moves: int = 0


def fleet(rows_a: int) -> list[FleetWorker]:
    return [FleetWorker("a", 0, decode_rows=rows_a, decode_step_ms=12.5), FleetWorker("b", 0)]


def test_a_round_marks_the_runs_with_most_tokens_left():
    runs = [Run("a", n) for n in (5, 50, 500, 1)] + [Run("b", 900)]
    mover = Mover(lambda: fleet(4), slo_tpot_ms=12.0, interval_s=0.0)
    for r in runs:
        mover.running.add(r)
    assert mover.round() == 2                                         # (4 - 0) // 2
    assert [r.move_to for r in runs] == [None, "b", "b", None, None]


def test_a_run_moves_at_most_once_and_not_when_ending():
    moved = Run("a", 100, moves=MAX_MOVES_PER_REQUEST)
    last = Run("a", 1)                                                # its next token is its last
    between = Run(None, 100)                                          # between two attempts
    mover = Mover(lambda: fleet(4), slo_tpot_ms=12.0, interval_s=0.0)
    mover.running.update((moved, last, between))
    assert mover.round() == 0


def test_the_loop_runs_rounds_until_closed():
    async def main() -> int:
        calls = []
        mover = Mover(lambda: calls.append(1) or fleet(0), slo_tpot_ms=12.0, interval_s=0.01)
        mover.track(Run("a", 10))
        await asyncio.sleep(0.1)
        await mover.close()
        seen = len(calls)
        await asyncio.sleep(0.05)
        assert len(calls) == seen
        return seen
    assert asyncio.run(main()) >= 3
