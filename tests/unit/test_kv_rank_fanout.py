"""Rank 0's orchestration of a KV transfer between tensor-parallel workers (rank_fanout) with the
other ranks' agents (rank_agent), in one process: each worker's ranks 1..N-1 are RankKvAgents
fed through a link (as the command pipe feeds them), reporting in a real TCPStore; the channels
are real Gloo pair channels. A P TP2 -> D TP2 transfer lands each decode rank's heads and the
first token; a rank whose order is lost fails the transfer on both sides, the prefill worker's
epoch moves on, and the next transfer on the new epoch lands."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from kv_pools import GEOM, poisoned_pool, same_bits, source_pool

from pdserve.common.kv_transfer import FirstTokenRef, KvReceiver, KvSender, KvStoreServer, KvTransferError, rank_fanout
from pdserve.common.kv_transfer.layout import KvLayout, rank_name, routes
from pdserve.common.kv_transfer.rank_agent import RankKvAgent, RankPlan
from pdserve.common.kv_transfer.rank_fanout import RankReports

pytestmark = pytest.mark.timeout(120)
HEADS, TIMEOUT = GEOM[3], 1.0


class Link:
    """A worker's ranks 1..N-1 in this process: what rank 0 sends reaches each agent in order;
    ``drop`` loses the next message (a rank that never gets its order)."""

    def __init__(self, pools: list[torch.Tensor]) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, len(pools), True, timeout=datetime.timedelta(seconds=30),
                                   wait_for_workers=False)
        self.agents = [RankKvAgent(r, self.store.port, (lambda p=p: p), 30.0) for r, p in enumerate(pools)][1:]
        self.drop = False

    def send(self, message: dict) -> None:
        if self.drop:
            self.drop = False
            return
        for agent in self.agents:
            agent.handle(message)

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


def _shards(full: torch.Tensor, layout: KvLayout) -> list[torch.Tensor]:
    return [full[:, :, :, :, slice(*layout.kv_heads(r))].contiguous() for r in range(layout.tensor_parallel_size)]


@pytest.fixture
def pair():
    layout = KvLayout(2, HEADS, GEOM[4])
    full = source_pool(5, "float32")
    src, dst = _shards(full, layout), _shards(poisoned_pool("float32"), layout)
    store = KvStoreServer("127.0.0.1", 0)
    p_link, d_link = Link(src), Link(dst)
    sender = KvSender(rank_name("P", 0, 2), timeout=TIMEOUT, pair_secrets=True)
    receiver = KvReceiver(dst[0], rank_name("D", 0, 2), store, timeout=TIMEOUT)
    p_reports, d_reports = RankReports(p_link), RankReports(d_link)
    yield layout, full, src, dst, store, (p_link, d_link), (sender, receiver), (p_reports, d_reports)
    sender.close()
    receiver.close()
    for x in (p_link, d_link, p_reports, d_reports):
        x.close()
    store.close()


def _transfer(pair, src_ids: list[int], dst_ids: list[int], token: int):
    layout, _, src, _, store, _, (sender, receiver), (p_reports, d_reports) = pair
    key = rank_name("D", 0, 2)
    epoch, secret = sender.next_epoch(key), sender.pair_secret(key)
    plan = RankPlan("P", 2, "D", 2, tuple(routes(layout, layout)), store.local_address, epoch, secret, (), TIMEOUT)
    future = rank_fanout.post(receiver, d_reports, RankPlan(**{**plan.__dict__, "block_ids": tuple(dst_ids)}),
                              with_first_token=True)
    pending = rank_fanout.start_send(sender, p_reports, RankPlan(**{**plan.__dict__, "block_ids": tuple(src_ids)}),
                                     src[0], first_token=FirstTokenRef(torch.tensor([token]), None, 0))
    return epoch, pending, future


def test_p2_to_d2_lands_each_ranks_heads(pair):
    layout, full, _, dst, *_ = pair
    src_ids, dst_ids = [1, 2, 3, 11], [20, 4, 5, 6]
    _, pending, future = _transfer(pair, src_ids, dst_ids, 77)
    sent, _ = pending.wait()
    got = future.result(timeout=30)
    assert got.first_token == (77, 0.0) and got.num_bytes == sent == len(src_ids) * full[0].numel() * 4
    for rank, pool in enumerate(dst):
        h0, h1 = layout.kv_heads(rank)
        assert all(same_bits(pool[t], full[s, :, :, :, h0:h1]) for s, t in zip(src_ids, dst_ids))


def test_a_lost_rank_order_fails_both_sides_and_the_next_epoch_lands(pair):
    layout, full, _, dst, _, (p_link, _), (sender, _), _ = pair
    p_link.drop = True                    # prefill rank 1 never sends: decode rank 1 waits in vain
    epoch, pending, future = _transfer(pair, [1, 2], [3, 4], 5)
    with pytest.raises(KvTransferError, match="rank"):
        pending.wait()
    with pytest.raises(KvTransferError, match="rank 1"):
        future.result(timeout=30)
    assert sender.next_epoch(rank_name("D", 0, 2)) > epoch
    src_ids, dst_ids = [7, 8, 9], [10, 11, 12]
    _, pending, future = _transfer(pair, src_ids, dst_ids, 9)
    pending.wait()
    assert future.result(timeout=30).first_token == (9, 0.0)
    for rank, pool in enumerate(dst):
        h0, h1 = layout.kv_heads(rank)
        assert all(same_bits(pool[t], full[s, :, :, :, h0:h1]) for s, t in zip(src_ids, dst_ids))
