"""Ranks of a tensor-parallel group as threads of the test's process."""
from __future__ import annotations

import threading
from collections.abc import Callable


def run_in_threads(size: int, work: Callable[[int], object], join_s: float) -> list:
    """``[work(0), ..., work(size - 1)]``, each on a thread of its own, joined within ``join_s``
    seconds each; the first exception a thread raised is raised here."""
    out: list = [None] * size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            out[rank] = work(rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_s)
    if errors:
        raise errors[0]
    return out
