"""KvReceiver's per-peer threads and channels stay bounded (one process, Gloo over loopback, real
stores): forged posts from unknown prefill workers leave no thread once they fail; restarted
prefill workers (same id with a new epoch, or a new id) replace their channel instead of adding
one, at most ``max_peers`` are live, the rest are retired like idle ones, and idle ones end their
thread. Thread counts are the KV transfer's threads of this process (``_kv_threads``)."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

from pdserve.common.kv_transfer import KvReceiver, KvSender, KvStoreServer, KvTransferError

GEOM = (2, 2, 4, 2, 8)     # one block: layers, k/v, block size, kv heads, head dim

pytestmark = pytest.mark.timeout(60)


def _until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def _kv_threads() -> int:
    """The KV transfer's threads alive in this process (``kv-recv-*``, ``kv-join-*``); threads of
    other tests' clients and servers come and go on their own."""
    return sum(t.name.startswith("kv-") for t in threading.enumerate())


def test_forged_posts_from_unknown_peers_leave_no_thread() -> None:
    baseline = _kv_threads()
    with KvStoreServer("127.0.0.1", 0) as server, \
            KvReceiver(torch.zeros(16, *GEOM), "d", server, timeout=1.0, max_records=4) as recv:
        with pytest.raises(KvTransferError):      # an id no channel can be named after: refused at once
            recv.post("a/b", 1, [0])
        assert recv.num_peers() == 0
        # ten PushKV from ten prefill workers that never join (forged, or dead before sending)
        futures = [recv.post(f"forged-{i}", 1, [i], with_first_token=True) for i in range(10)]
        assert recv.num_threads() == 10           # each joining, until its timeout
        for f in futures:
            with pytest.raises(KvTransferError, match="did not join"):
                f.result(timeout=10)
        _until(lambda: recv.num_threads() == 0 and _kv_threads() == baseline,
               f"receive threads ended ({recv.num_threads()} left, {_kv_threads()} vs {baseline})")
        assert recv.num_open_channels() == 0
        # their broken epochs are still refused at once, from the records
        with pytest.raises(KvTransferError, match="broken"):
            recv.post("forged-9", 1, [0])
        # records hold nothing but epochs; the least recently used ones go beyond max_records
        recv.post("one-more", 1, [])
        assert recv.num_peers() <= 4
    assert _kv_threads() == baseline


def _restart_and_send(recv: KvReceiver, server: KvStoreServer, name: str, epoch: int, src: torch.Tensor,
                      ids: list[int]) -> None:
    """A prefill worker (re)started as ``name`` at ``epoch`` ships blocks ``ids``, then goes away."""
    sender = KvSender(name, timeout=10, first_epoch=epoch)
    try:
        with sender.lock("d"):
            fut = recv.post(name, epoch, ids)
            sender.send_blocks("d", server.address, epoch, src, ids)
        assert fut.result(timeout=10).num_bytes == len(ids) * recv.block_bytes
    finally:
        sender.close()


def test_restarted_prefill_workers_replace_their_channels_and_threads() -> None:
    src = torch.randn(16, *GEOM)
    baseline = _kv_threads()
    with KvStoreServer("127.0.0.1", 0) as server, \
            KvReceiver(torch.zeros(16, *GEOM), "d", server, timeout=10, idle_close_s=0.0, max_peers=2) as recv:
        # the same prefill worker id restarted five times: each new epoch replaces the channel
        for epoch in range(1, 6):
            _restart_and_send(recv, server, "p", epoch, src, [epoch])
            assert recv.num_threads() <= 1 and recv.num_open_channels() <= 1
        # five prefill workers with new ids (a restart under a new id): at most max_peers live
        for i in range(5):
            _restart_and_send(recv, server, f"q{i}", 1, src, [8 + i])
            assert recv.num_threads() <= 2 and recv.num_open_channels() <= 2
            _until(lambda: _kv_threads() <= baseline + 2, "at most two receive threads")
        assert recv.num_channels_evicted == 4     # p, q0, q1, q2 made room for q1..q4
        for b in [*range(1, 6), *range(8, 13)]:
            assert torch.equal(recv.kv_cache[b], src[b])
        # a retired channel's epoch is refused at once (its sender moves to a new one)
        with pytest.raises(KvTransferError, match="broken"):
            recv.post("q0", 1, [0])
        # the peers went away: their channels close when idle, and their threads end
        recv.idle_close_s = 0.1
        time.sleep(0.15)
        assert recv.close_idle() == 2
        _until(lambda: recv.num_threads() == 0 and _kv_threads() == baseline,
               f"receive threads ended ({recv.num_threads()} left)")


def test_an_idle_channel_ends_its_thread_without_another_post() -> None:
    src = torch.randn(4, *GEOM)
    baseline = _kv_threads()
    with KvStoreServer("127.0.0.1", 0) as server, \
            KvReceiver(torch.zeros(4, *GEOM), "d", server, timeout=10, idle_close_s=0.3) as recv:
        _restart_and_send(recv, server, "p", 1, src, [2])
        assert recv.num_open_channels() == 1
        _until(lambda: recv.num_threads() == 0 and _kv_threads() == baseline,
               "the idle channel's thread ended", timeout=5)
        assert recv.num_open_channels() == 0 and recv.num_channels_closed_idle == 1
        _restart_and_send(recv, server, "p", 2, src, [3])     # the next epoch builds a new one
        assert torch.equal(recv.kv_cache[3], src[3])
