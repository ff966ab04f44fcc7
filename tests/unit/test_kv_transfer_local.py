"""KV transfer on CPU (Gloo) within one process: gather/scatter round trips, chunk plans, the
first-token message, in-process transfers (ordering, chunking, errors), pair channels and the
KV store address. Between processes: test_kv_transfer.py.
"""

import threading
import time

import pytest
import torch
from kv_pools import GEOM, NUM_BLOCKS, POISON, check_landed, poisoned_pool, same_bits, source_pool

from pdserve.common.kv_transfer import (
    KvReceiver,
    KvSender,
    KvStoreServer,
    KvTransferError,
    PairChannel,
    bytes_per_block,
    gather_blocks,
    plan_chunks,
    scatter_blocks,
)
from pdserve.common.kv_transfer.blocks import contiguous_range

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ (5) single process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(NUM_BLOCKS, *GEOM, generator=g).to(dtype)
    ids = [7, 2, 19, 3, 11]
    gathered = gather_blocks(src, ids)
    assert gathered.shape == (len(ids), *GEOM) and gathered.is_contiguous()
    for i, b in enumerate(ids):
        assert same_bits(gathered[i], src[b])
    # into a reusable (larger) staging buffer
    staging = torch.empty(10 * src[0].numel(), dtype=dtype)
    out = gather_blocks(src, ids, out=staging)
    assert out.data_ptr() == staging.data_ptr() and same_bits(out, gathered)
    with pytest.raises(KvTransferError):
        gather_blocks(src, ids, out=torch.empty(3, dtype=dtype))
    dst = torch.full_like(src, POISON)
    dst_ids = [0, 23, 5, 6, 12]
    scatter_blocks(dst, dst_ids, gathered)
    assert check_landed(dst, src, ids, dst_ids, set(dst_ids)) == []
    # tensor ids work too
    scatter_blocks(dst, torch.tensor([1]), gather_blocks(src, torch.tensor([4])))
    assert same_bits(dst[1], src[4])


def test_chunk_plan():
    bb = 1000
    assert plan_chunks(0, bb, 5000) == []
    assert plan_chunks(5, bb, 5000) == [(0, 5)]
    assert plan_chunks(11, bb, 5000) == [(0, 5), (5, 10), (10, 11)]
    assert plan_chunks(3, bb, 10) == [(0, 1), (1, 2), (2, 3)]  # at least one block
    assert contiguous_range([4, 5, 6]) == (4, 7)
    assert contiguous_range([4, 6]) is None and contiguous_range([]) is None
    # chunked gather + scatter round trip
    g = torch.Generator().manual_seed(3)
    src = torch.randn(NUM_BLOCKS, *GEOM, generator=g)
    dst = torch.full_like(src, POISON)
    ids = [9, 1, 2, 3, 17, 0, 22]
    dst_ids = [4, 5, 6, 7, 20, 10, 8]
    for s, e in plan_chunks(len(ids), bytes_per_block(src), 2 * bytes_per_block(src) + 1):
        scatter_blocks(dst, dst_ids[s:e], gather_blocks(src, ids[s:e]))
    assert check_landed(dst, src, ids, dst_ids, set(dst_ids)) == []


def test_first_token_message_round_trip():
    from pdserve.common.kv_transfer import FirstTokenRef
    from pdserve.common.kv_transfer.transfer import parse_first_token
    ids = torch.tensor([5, 151_935, 7])
    lps = torch.tensor([-0.5, -1.25, -3.0])
    msg = FirstTokenRef(ids, lps, 1).message()
    assert msg.dtype == torch.int32 and msg.numel() == 2
    assert parse_first_token(msg) == (151_935, -1.25)
    assert parse_first_token(FirstTokenRef(ids, None, 2).message()) == (7, 0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", ["per_block", "staged", "contiguous", "chunked"])
def test_in_process_first_token_rides_in_the_last_message(case, dtype):
    """The first token's 8 bytes end the last message, whatever path the blocks take: one
    message per block (consecutive ids each), one staged message, consecutive ids on both
    sides, several chunks (Gloo over loopback, two threads)."""
    from pdserve.common.kv_transfer import FirstTokenRef
    src = source_pool(5, dtype)
    dst = poisoned_pool(dtype)
    bb = bytes_per_block(src)
    max_msg = {"per_block": bb, "chunked": 2 * bb}.get(case, 1 << 40)
    src_ids, dst_ids = {"per_block": ([4, 9, 0], [2, 17, 11]), "staged": ([4, 9, 0], [2, 17, 11]),
                        "contiguous": ([5, 6, 7], [12, 13, 14]),
                        "chunked": ([3, 8, 1, 20, 21], [0, 9, 10, 4, 16])}[case]
    with KvStoreServer("127.0.0.1", 0) as server:
        recv = KvReceiver(dst, "d", server, timeout=10, max_message_bytes=max_msg)
        sender = KvSender("p", timeout=10, max_message_bytes=max_msg, first_epoch=1)
        with pytest.raises(KvTransferError):
            recv.post("p", 1, [], with_first_token=True)
        fut = recv.post("p", 1, dst_ids, with_first_token=True)
        token = FirstTokenRef(torch.tensor([3, 42]), torch.tensor([-0.1, -2.5]), 1)
        nbytes, _ = sender.send_blocks("d", server.address, 1, src, src_ids, first_token=token)
        got = fut.result(timeout=10)
        assert got.num_bytes == nbytes == len(src_ids) * bb and got.first_token == (42, -2.5)
        assert check_landed(dst, src, src_ids, dst_ids, set(dst_ids)) == []
        with pytest.raises(KvTransferError):   # a first token needs a block to follow
            sender.send_blocks("d", server.address, 1, src, [], first_token=token)
        sender.close()
        recv.close()


def test_in_process_sends_started_before_the_previous_one_crossed():
    """start_send returns once a send is enqueued; several can be started in PushKV order and
    waited afterwards (Gloo: each start waits for the pair's previous send itself)."""
    src = source_pool(6, "bfloat16")
    dst = poisoned_pool("bfloat16")
    bb = bytes_per_block(src)
    transfers = [([1, 4], [7, 2]), ([9], [3]), ([11, 12, 13], [20, 21, 22])]
    with KvStoreServer("127.0.0.1", 0) as server:
        recv = KvReceiver(dst, "d", server, timeout=10)
        sender = KvSender("p", timeout=10, first_epoch=2)
        futures = [recv.post("p", 2, d) for _, d in transfers]
        pending = [sender.start_send("d", server.address, 2, src, s) for s, _ in transfers]
        assert [p.wait()[0] for p in pending] == [len(s) * bb for s, _ in transfers]
        assert [f.result(timeout=10).num_bytes for f in futures] == [len(s) * bb for s, _ in transfers]
        assert pending[0].wait()[0] == 2 * bb            # waiting again gives the same result
        assert check_landed(dst, src, [i for s, _ in transfers for i in s],
                             [i for _, d in transfers for i in d],
                             {i for _, d in transfers for i in d}) == []
        assert sender.next_epoch("d") == 2               # no failure: same epoch
        sender.close()
        recv.close()


def test_in_process_chunked_transfer_and_errors():
    """Sender and receiver in one process (two threads, Gloo over loopback): transfers
    chunked into 1-block messages, contiguous and scattered ids, zero blocks, bad input."""
    g = torch.Generator().manual_seed(4)
    src = torch.randn(NUM_BLOCKS, *GEOM, generator=g).to(torch.bfloat16)
    dst = torch.full_like(src, POISON)
    bb = bytes_per_block(src)
    with KvStoreServer("127.0.0.1", 0) as server:
        recv = KvReceiver(dst, "d", server, timeout=10, max_message_bytes=bb)
        sender = KvSender("p", timeout=10, max_message_bytes=bb, first_epoch=3)
        transfers = [([5, 1, 9, 2], [10, 11, 12, 13]),   # contiguous destination
                     ([0, 1, 2], [3, 0, 22]),
                     ([], []),
                     ([7], [1])]
        futures = []
        for _, dst_ids in transfers:
            with sender.lock("d"):
                futures.append(recv.post("p", sender.next_epoch("d"), dst_ids))
        results = []

        def send_all():
            for src_ids, _ in transfers:
                results.append(sender.send_blocks("d", server.address, 3, src, src_ids))

        t = threading.Thread(target=send_all)
        t.start()
        t.join(30)
        assert not t.is_alive()
        touched = set()
        for (src_ids, dst_ids), fut, (nbytes, _secs) in zip(transfers, futures, results):
            got, event, first = fut.result(timeout=10)
            assert got == nbytes == len(src_ids) * bb and event is None and first is None
            touched.update(dst_ids)
        assert check_landed(dst, src, [i for s, _ in transfers for i in s],
                             [i for _, d in transfers for i in d], touched) == []
        # bad input is refused at once
        with pytest.raises(KvTransferError):
            recv.post("p", 3, [1, 1])
        with pytest.raises(KvTransferError):
            recv.post("p", 3, [NUM_BLOCKS])
        with pytest.raises(KvTransferError):
            recv.post("p", 2, [1])          # stale epoch
        with pytest.raises(KvTransferError):
            sender.send_blocks("d", server.address, 99, src, [1])  # not the current epoch
        assert sender.next_epoch("d") == 4  # a failed send bumps the epoch
        sender.close()
        recv.close()
        with pytest.raises(KvTransferError):
            recv.post("p", 5, [1])


def test_pair_channel_send_recv_and_timeout():
    with KvStoreServer("127.0.0.1", 0) as server:
        chans = {}

        def join(rank):
            chans[rank] = PairChannel(server.address, "p", "d", 1, rank, "cpu", timeout=2.0)

        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        a, b = chans[0], chans[1]
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        y = torch.zeros_like(x)
        t = threading.Thread(target=a.send, args=(x,))
        t.start()
        assert b.recv(y) is None
        t.join(5)
        assert torch.equal(x, y)
        t0 = time.monotonic()
        with pytest.raises(KvTransferError):
            b.recv(y)        # nobody sends
        assert time.monotonic() - t0 < 4.0
        assert b.is_broken
        a.close(), b.close()
        # nobody joins: the rendezvous times out
        t0 = time.monotonic()
        with pytest.raises(KvTransferError):
            PairChannel(server.address, "p", "d", 2, 1, "cpu", timeout=1.0)
        assert time.monotonic() - t0 < 3.0


def test_store_address():
    s = KvStoreServer("0.0.0.0", 0)
    host, port = s.address.rsplit(":", 1)
    assert int(port) == s.port > 0 and host
    assert s.local_address == f"127.0.0.1:{s.port}"
    s.close()
    with pytest.raises(KvTransferError):
        _ = s.store


def test_pair_channel_cta_cap():
    """``max_ctas`` lands in the NCCL communicator's config (never above it: min_ctas follows);
    a negative cap is refused before anything is built."""
    from types import SimpleNamespace

    from pdserve.common.kv_transfer.process_group import cap_ctas
    opts = SimpleNamespace(config=SimpleNamespace(max_ctas=32, min_ctas=8))
    cap_ctas(opts, 4)
    assert (opts.config.max_ctas, opts.config.min_ctas) == (4, 4)
    opts = SimpleNamespace(config=SimpleNamespace(max_ctas=32, min_ctas=1))
    cap_ctas(opts, 2)
    assert (opts.config.max_ctas, opts.config.min_ctas) == (2, 1)
    cap_ctas(SimpleNamespace(), 4)           # a torch without per-communicator config: left as is
    with pytest.raises(KvTransferError, match="max_ctas must be >= 0"):
        PairChannel("127.0.0.1:1", "p", "d", 1, 0, "cpu", max_ctas=-1)
