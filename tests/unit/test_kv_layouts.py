"""KV between tensor-parallel layouts: the routes cover every decode rank's heads once, from a
prefill rank that holds them; and the head-sliced sends of those routes, over real Gloo pair
channels (one KvSender per prefill rank, one KvReceiver per decode rank, in threads), land each
decode rank's share of the model's KV bit for bit, leaving other blocks alone."""
from __future__ import annotations

import pytest
import torch
from kv_pools import GEOM, NUM_BLOCKS, POISON, poisoned_pool, same_bits, source_pool

from pdserve.common.grpc_utils.errors import FailedPrecondition
from pdserve.common.kv_transfer import FirstTokenRef, KvReceiver, KvSender, KvStoreServer, KvTransferError
from pdserve.common.kv_transfer.layout import KvLayout, pair_error, rank_name, routes
from pdserve.decode_worker.validation import check_kv_layout
from pdserve.prefill_worker.validation import Limits

pytestmark = pytest.mark.timeout(120)
HEADS = GEOM[3]          # the tiny pools' KV heads (2)


@pytest.mark.parametrize("num_kv_heads", [1, 2, 3, 4, 8])
def test_routes_cover_each_decode_rank_once(num_kv_heads):
    sizes = [s for s in (1, 2, 3, 4, 8) if s <= num_kv_heads or s % num_kv_heads == 0]
    for p in sizes:
        for d in sizes:
            pre, dec = KvLayout(p, num_kv_heads, 64), KvLayout(d, num_kv_heads, 64)
            got = routes(pre, dec)
            assert (got[0].src, got[0].dst, got[0].src_heads[0], got[0].dst_heads[0]) == (0, 0, 0, 0)
            for dst in range(d):
                d0, d1 = dec.kv_heads(dst)
                covered = []
                for r in (r for r in got if r.dst == dst):
                    s0 = pre.kv_heads(r.src)[0]
                    assert r.num_heads == r.dst_heads[1] - r.dst_heads[0] > 0
                    # the same global heads on both ends
                    assert [s0 + h for h in range(*r.src_heads)] == [d0 + h for h in range(*r.dst_heads)]
                    covered += [d0 + h for h in range(*r.dst_heads)]
                assert covered == list(range(d0, d1)), (p, d, dst)


def test_layouts_that_cannot_pair_name_both():
    assert pair_error(KvLayout(2, 8, 128, "bfloat16"), KvLayout(1, 8, 128, "bfloat16")) is None
    assert pair_error(KvLayout(2, 8, 128), KvLayout(1, 0, 0)) is None          # unknown: not compared
    for other in (KvLayout(1, 4, 128, "bfloat16"), KvLayout(1, 8, 64, "bfloat16"),
                  KvLayout(1, 8, 128, "float8_e4m3fn")):
        why = pair_error(KvLayout(2, 8, 128, "bfloat16"), other)
        assert why is not None and str(KvLayout(2, 8, 128, "bfloat16")) in why and str(other) in why
        with pytest.raises(ValueError):
            routes(KvLayout(2, 8, 128, "bfloat16"), other)
    assert rank_name("w", 1, 2) == "w.r1" and rank_name("w", 0, 1) == "w"


def _shard(full: torch.Tensor, layout: KvLayout, rank: int) -> torch.Tensor:
    h0, h1 = layout.kv_heads(rank)
    return full[:, :, :, :, h0:h1].contiguous()


def _pools(heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded source pool and a poisoned one of ``heads`` KV heads (the tiny geometry otherwise)."""
    if heads == HEADS:
        return source_pool(3, "float32"), poisoned_pool("float32")
    shape = (NUM_BLOCKS, *GEOM[:3], heads, GEOM[4])
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)), torch.full(shape, POISON)


@pytest.mark.parametrize("heads,p,d", [(2, 1, 2), (2, 2, 1), (2, 2, 2), (2, 1, 4), (2, 4, 1),
                                       (3, 2, 3), (3, 3, 2), (3, 2, 1), (3, 1, 3)])
def test_route_sends_land_each_decode_ranks_heads(heads, p, d):
    """What the ranks of two workers do for one transfer (rank_agent / rank_fanout), in threads;
    3 heads split unevenly (2 + 1) over 2 ranks."""
    pre, dec = KvLayout(p, heads, GEOM[4]), KvLayout(d, heads, GEOM[4])
    full, poisoned = _pools(heads)
    src_pools = [_shard(full, pre, r) for r in range(p)]
    dst_pools = [_shard(poisoned, dec, r) for r in range(d)]
    src_ids, dst_ids = [3, 4, 5, 9], [10, 2, 7, 8]
    store = KvStoreServer("127.0.0.1", 0)
    senders = [KvSender(rank_name("P", r, p), timeout=20, pair_secrets=True) for r in range(p)]
    receivers = [KvReceiver(dst_pools[r], rank_name("D", r, d), store, timeout=20) for r in range(d)]
    plan = routes(pre, dec)
    try:
        key = rank_name("D", 0, d)
        epoch, secret = senders[0].next_epoch(key), senders[0].pair_secret(key)
        futures = [receivers[r.dst].post(rank_name("P", r.src, p), epoch, dst_ids, secret=secret, heads=r.dst_heads,
                                         with_first_token=r.src == r.dst == 0) for r in plan]
        pending = []
        for r in plan:
            sender, dst = senders[r.src], rank_name("D", r.dst, d)
            sender.adopt_epoch(dst, epoch, secret)
            token = FirstTokenRef(torch.tensor([41]), None, 0) if r.src == r.dst == 0 else None
            pending.append(sender.start_send(dst, store.local_address, epoch, src_pools[r.src], src_ids,
                                             heads=r.src_heads, first_token=token))
        sent = sum(x.wait()[0] for x in pending)
        got = [f.result(timeout=30) for f in futures]
    finally:
        for s in senders:
            s.close()
        for rcv in receivers:
            rcv.close()
        store.close()
    assert got[0].first_token == (41, 0.0)
    assert sent == sum(g.num_bytes for g in got) == len(src_ids) * full[0].numel() // heads * 4 * sum(
        r.num_heads for r in plan)
    for rank, pool in enumerate(dst_pools):
        expect = _shard(full, dec, rank)
        for s, t in zip(src_ids, dst_ids):
            assert same_bits(pool[t], expect[s]), (rank, t)
        untouched = [b for b in range(pool.shape[0]) if b not in dst_ids]
        assert bool((pool[untouched] == POISON).all())


def test_a_head_range_outside_the_pool_is_refused():
    store = KvStoreServer("127.0.0.1", 0)
    receiver = KvReceiver(poisoned_pool("float32"), "D", store, timeout=5)
    try:
        with pytest.raises(KvTransferError, match="outside the pool"):
            receiver.post("P", 1, [1], heads=(1, 3))
    finally:
        receiver.close()
        store.close()


def test_reserve_refuses_a_layout_that_cannot_pair_naming_both():
    """The decode worker's Reserve check: any split pairs; other heads, head_dim, dtype, or a
    prefill split the model's heads do not allow, are FAILED_PRECONDITION naming both layouts."""
    limits = Limits(512, 256, 64, 4096, "float32", 2, 2, 16, 8192)
    for ok in (KvLayout(1, 2, 16, "float32"), KvLayout(2, 2, 16, ""), KvLayout(4, 0, 0, "")):
        check_kv_layout(ok, limits)
    mine = str(KvLayout(2, 2, 16, "float32"))
    for bad in (KvLayout(1, 4, 16, ""), KvLayout(1, 2, 32, ""), KvLayout(1, 2, 16, "bfloat16"), KvLayout(3, 2, 16, "")):
        with pytest.raises(FailedPrecondition) as e:
            check_kv_layout(bad, limits)
        assert mine in str(e.value) and str(bad.tensor_parallel_size) in str(e.value)
