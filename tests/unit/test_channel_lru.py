"""Pair channels at scale: the closing rule (pure, hand-computed) and KvSender / KvReceiver
closing idle and least-recently-used channels and re-creating them transparently (Gloo over
loopback, one process, real stores)."""
from __future__ import annotations

import time

import torch

from pdserve.common.kv_transfer import KvReceiver, KvSender, KvStoreServer
from pdserve.common.kv_transfer.channel_lru import channels_to_close

GEOM = (2, 2, 4, 2, 8)     # one block: layers, k/v, block size, kv heads, head dim


def test_idle_channels_close_whatever_the_cap() -> None:
    last = {"a": 0.0, "b": 5.0, "c": 9.0}
    # now 10, idle 5: a (idle 10) and b (idle 5) close; c (idle 1) stays
    assert channels_to_close(last, 10.0, max_open=0, idle_s=5.0) == ["a", "b"]
    assert channels_to_close(last, 10.0, max_open=0, idle_s=0.0) == []      # never idle-closed


def test_cap_closes_least_recently_used_first_and_skips_busy() -> None:
    last = {"a": 3.0, "b": 1.0, "c": 2.0}
    # 3 open + 1 opening > cap 2: two must go, oldest first: b (1.0), c (2.0)
    assert channels_to_close(last, 4.0, max_open=2, idle_s=0.0, opening=1) == ["b", "c"]
    # b busy: the next oldest not busy are c, a
    assert channels_to_close(last, 4.0, max_open=2, idle_s=0.0, busy={"b"}, opening=1) == ["c", "a"]
    # everything busy: nothing can close (the new channel is opened anyway)
    assert channels_to_close(last, 4.0, max_open=1, idle_s=0.0, busy={"a", "b", "c"}, opening=1) == []
    # within the cap: nothing
    assert channels_to_close(last, 4.0, max_open=4, idle_s=0.0, opening=1) == []
    # idle ones count toward making room: a idle (>= 0.5) closes, then one more by LRU
    assert channels_to_close({"a": 0.0, "b": 3.9, "c": 3.8}, 4.0, max_open=1, idle_s=1.0,
                             opening=1) == ["a", "c", "b"]


def _send(sender: KvSender, recv: KvReceiver, name: str, server: KvStoreServer, src: torch.Tensor,
          ids: list[int]) -> None:
    with sender.lock(name):
        epoch = sender.next_epoch(name)
        fut = recv.post("p", epoch, ids)
        sender.send_blocks(name, server.address, epoch, src, ids)
    assert fut.result(timeout=20).num_bytes > 0


def test_sender_cap_and_idle_close_recreate_transparently() -> None:
    src = torch.randn(8, *GEOM)
    servers = [KvStoreServer("127.0.0.1", 0) for _ in range(3)]
    recvs = [KvReceiver(torch.zeros(8, *GEOM), f"d{i}", s, timeout=20, idle_close_s=0.0)
             for i, s in enumerate(servers)]
    sender = KvSender("p", timeout=20, first_epoch=1, max_channels=2, idle_close_s=0.0)
    try:
        for i in range(3):
            _send(sender, recvs[i], f"d{i}", servers[i], src, [i])
        assert sender.num_open_channels() == 2 and sender.next_epoch("d0") == 2   # d0 closed (LRU)
        _send(sender, recvs[0], "d0", servers[0], src, [5])                        # re-created
        assert torch.equal(recvs[0].kv_cache[5], src[5])
        assert sender.num_open_channels() == 2 and sender.num_channels_opened == 4
        sender.idle_close_s = 0.2
        time.sleep(0.25)
        assert sender.next_epoch("d2") == 2                    # idle: closed, new epoch
        _send(sender, recvs[2], "d2", servers[2], src, [6])
        assert torch.equal(recvs[2].kv_cache[6], src[6])
        # the decode side closes its idle channels too, and refuses their epoch afterwards
        recvs[1].idle_close_s = 0.2
        time.sleep(0.25)
        assert recvs[1].num_open_channels() == 1 and recvs[1].close_idle() == 1
        assert recvs[1].num_open_channels() == 0
    finally:
        sender.close()
        for r in recvs:
            r.close()
        for s in servers:
            s.close()
