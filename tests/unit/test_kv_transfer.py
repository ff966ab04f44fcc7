"""KV transfer on CPU (Gloo): gather/scatter, pair channels, and the ordered sender/receiver
protocol between real processes (multiprocessing 'spawn').

The child processes report plain Python values through multiprocessing queues (never tensors).
The PushKV control call is played by a queue: the decode child posts its receive, then tells
the prefill child to send.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time

import pytest
import torch

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

# tiny geometry: [num_blocks, layers, 2, block_size, kv_heads, head_dim]
NUM_BLOCKS = 24
GEOM = (3, 2, 4, 2, 8)
POISON = 7.0
CHILD_WAIT = 30.0  # seconds a test waits for a child's answer before failing

pytestmark = pytest.mark.timeout(120)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _source_pool(seed: int, dtype: str, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *GEOM, generator=g).to(_dtype(dtype))


def _poisoned_pool(dtype: str, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.full((num_blocks, *GEOM), POISON, dtype=_dtype(dtype))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(_bits(a.contiguous()), _bits(b.contiguous())))


def _check_landed(pool: torch.Tensor, src: torch.Tensor, src_ids, dst_ids,
                  touched: set[int]) -> list[str]:
    """Errors (empty when fine): dst blocks == src blocks bit for bit; blocks outside
    ``touched`` still poisoned."""
    errors = []
    for s, d in zip(src_ids, dst_ids):
        if not _same_bits(pool[d], src[s]):
            errors.append(f"block {d} != source block {s}")
    poison = torch.full_like(pool[0], POISON)
    for b in range(pool.shape[0]):
        if b not in touched and not _same_bits(pool[b], poison):
            errors.append(f"untouched block {b} changed")
    return errors


# ------------------------------------------------------------------ child processes
def _decode_child(cfg: dict, addr_q, go_qs: dict, res_q) -> None:
    """Hosts the store and one receiver per decode worker id of cfg['dtypes'] (each with its
    own pool: one process playing several decode workers), posts the receives in the order of
    cfg['plan'], checks what landed.

    plan: list of (prefill_id, decode_id, epoch, seed, src_ids, dst_ids). For each item the
    decode side posts the receive, then puts its index on go_qs[prefill_id] (the PushKV
    answer).
    """
    try:
        torch.set_num_threads(1)
        with KvStoreServer("127.0.0.1", 0) as server:
            addr_q.put(server.address)
            pools, recvs = {}, {}
            for did, dtype in cfg["dtypes"].items():
                pools[did] = _poisoned_pool(dtype)
                recvs[did] = KvReceiver(
                    pools[did], did, server, timeout=cfg.get("timeout", 10.0),
                    max_message_bytes=cfg.get("max_message_bytes", {}).get(did, 512 << 20))
            futures = []
            for i, (pid, did, epoch, _seed, _src_ids, dst_ids) in enumerate(cfg["plan"]):
                futures.append(recvs[did].post(pid, epoch, dst_ids))
                go_qs[pid].put(i)
            results = []
            touched = {did: {b for it in cfg["plan"] if it[1] == did for b in it[5]}
                       for did in pools}
            for (_pid, did, _epoch, seed, src_ids, dst_ids), fut in zip(cfg["plan"], futures):
                nbytes, event, _ = fut.result(timeout=CHILD_WAIT)
                assert event is None
                src = _source_pool(seed, cfg["dtypes"][did])
                results.append((nbytes, _check_landed(pools[did], src, src_ids, dst_ids,
                                                      touched[did])))
            # all transfers done: check again that no later transfer disturbed an earlier one
            final = []
            for _pid, did, _epoch, seed, src_ids, dst_ids in cfg["plan"]:
                src = _source_pool(seed, cfg["dtypes"][did])
                final += [f"{did} block {d} overwritten" for s, d in zip(src_ids, dst_ids)
                          if not _same_bits(pools[did][d], src[s])]
            for did, pool in pools.items():
                final += _check_landed(pool, pool, [], [], touched[did])
                recvs[did].close()
            res_q.put(("ok", results, final))
    except BaseException as e:  # noqa: BLE001
        res_q.put(("error", repr(e)))


def _prefill_child(cfg: dict, prefill_id: str, addr_q, go_q, res_q) -> None:
    """Sends, for each go signal, the next item of cfg['sends']
    (decode_id, epoch, seed, src_ids), from a pool of cfg['dtypes'][decode_id]."""
    try:
        torch.set_num_threads(1)
        addr = addr_q.get(timeout=CHILD_WAIT)
        addr_q.put(addr)  # leave it for the next reader
        sender = KvSender(prefill_id, timeout=cfg.get("timeout", 10.0),
                          first_epoch=cfg["epoch"])
        out = []
        for did, epoch, seed, src_ids in cfg["sends"]:
            go_q.get(timeout=CHILD_WAIT)
            pool = _source_pool(seed, cfg["dtypes"][did])
            sender.max_message_bytes = cfg.get("max_message_bytes", {}).get(did, 512 << 20)
            assert sender.next_epoch(did) == epoch
            nbytes, secs = sender.send_blocks(did, addr, epoch, pool, src_ids)
            out.append(nbytes)
        res_q.put(("ok", out))
        if cfg.get("die_after_next_go"):
            res_q.close()
            res_q.join_thread()   # flush the answer: os._exit skips the queue's feeder thread
            go_q.get(timeout=CHILD_WAIT)  # a receive is posted for us: exit without sending
            os._exit(0)
        sender.close()
    except BaseException as e:  # noqa: BLE001
        res_q.put(("error", repr(e)))


def _get(q, what: str, timeout: float = CHILD_WAIT):
    try:
        msg = q.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no answer from {what} within {timeout}s")
    assert msg[0] == "ok", f"{what} failed: {msg[1]}"
    return msg


def _reap(*procs) -> None:
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


@pytest.fixture(scope="module")
def ctx():
    return mp.get_context("spawn")


def _rand_ids(rng, n, exclude=()):
    ids = [b for b in range(NUM_BLOCKS) if b not in set(exclude)]
    rng.shuffle(ids)
    return ids[:n]


# ------------------------------------------------------------------ (1) + (2) one pair
def test_one_prefill_bit_exact_and_ordered(ctx):
    """One prefill process sends several transfers each to two decode workers (a bf16 pool
    and an fp32 pool, hosted by one decode process; one channel each): non-contiguous,
    unordered source ids; one contiguous destination (received in place); some cut into
    chunks. Each lands bit-exact in different block ids, in order; untouched blocks stay
    poisoned."""
    import random
    rng = random.Random(1)
    epoch = 5
    dtypes = {"decode0": "bfloat16", "decode1": "float32"}
    plan, used = [], {did: set() for did in dtypes}
    for k, n in enumerate([5, 1, 4, 3]):
        for did in dtypes:
            seed = 100 + k
            src = _rand_ids(rng, n)
            dst = _rand_ids(rng, n, exclude=used[did])
            if k == 2:
                start = min(b for b in range(NUM_BLOCKS - n + 1) if all(
                    x not in used[did] for x in range(b, b + n)))
                dst = list(range(start, start + n))       # contiguous: received in place
            used[did].update(dst)
            plan.append(("prefill0", did, epoch, seed, src, dst))
    cfg = {"dtypes": dtypes, "plan": plan, "epoch": epoch,
           "sends": [(did, ep, seed, src) for _, did, ep, seed, src, _ in plan],
           # two blocks per message: the 5- and 4-block transfers are cut into chunks
           "max_message_bytes": {did: 2 * bytes_per_block(_poisoned_pool(dt))
                                 for did, dt in dtypes.items()}}
    addr_q, res_d, res_p = ctx.Queue(), ctx.Queue(), ctx.Queue()
    go = {"prefill0": ctx.Queue()}
    d = ctx.Process(target=_decode_child, args=(cfg, addr_q, go, res_d))
    p = ctx.Process(target=_prefill_child, args=(cfg, "prefill0", addr_q, go["prefill0"], res_p))
    d.start(), p.start()
    try:
        _, sent = _get(res_p, "prefill")
        _, results, final = _get(res_d, "decode")
    finally:
        _reap(p, d)
    bb = {did: bytes_per_block(_poisoned_pool(dt)) for did, dt in dtypes.items()}
    assert sent == [len(it[4]) * bb[it[1]] for it in plan]
    for (nbytes, errs), item in zip(results, plan):
        assert nbytes == len(item[5]) * bb[item[1]]
        assert errs == []
    assert final == []


# ------------------------------------------------------------------ (3) two senders
def test_two_prefill_processes_to_one_decode(ctx):
    import random
    rng = random.Random(2)
    plan, sends = [], {"pA": [], "pB": []}
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    for k in range(3):
        for pid, epoch in (("pA", 11), ("pB", 22)):
            seed = 10 * k + (1 if pid == "pA" else 2)
            src = _rand_ids(rng, 3)
            dst = [free.pop() for _ in range(3)]
            plan.append((pid, "decode0", epoch, seed, src, dst))
            sends[pid].append(("decode0", epoch, seed, src))
    dtypes = {"decode0": "float32"}
    addr_q, res_d = ctx.Queue(), ctx.Queue()
    go = {"pA": ctx.Queue(), "pB": ctx.Queue()}
    d = ctx.Process(target=_decode_child,
                    args=({"dtypes": dtypes, "plan": plan}, addr_q, go, res_d))
    procs, res_p = [], {}
    for pid, epoch in (("pA", 11), ("pB", 22)):
        res_p[pid] = ctx.Queue()
        cfg = {"dtypes": dtypes, "sends": sends[pid], "epoch": epoch}
        procs.append(ctx.Process(target=_prefill_child,
                                 args=(cfg, pid, addr_q, go[pid], res_p[pid])))
    d.start()
    for p in procs:
        p.start()
    try:
        for pid in res_p:
            _get(res_p[pid], pid)
        _, results, final = _get(res_d, "decode")
    finally:
        _reap(*procs, d)
    assert all(errs == [] for _, errs in results)
    assert final == []


# ------------------------------------------------------------------ (4) peer death, restart
def _decode_restart_child(addr_q, go1, go2, res_q, timeout: float) -> None:
    try:
        torch.set_num_threads(1)
        with KvStoreServer("127.0.0.1", 0) as server:
            addr_q.put(server.address)
            pool = _poisoned_pool("float32")
            recv = KvReceiver(pool, "decode0", server, timeout=timeout)
            out = {}
            # 1. a normal transfer on epoch 7
            f = recv.post("prefill0", 7, [3, 1])
            go1.put(0)
            f.result(timeout=CHILD_WAIT)
            out["first"] = _check_landed(pool, _source_pool(1, "float32"), [0, 2], [3, 1],
                                         {1, 3})
            # 2. a receive that never gets its send: the sender process exits
            t0 = time.monotonic()
            f = recv.post("prefill0", 7, [5, 6])
            go1.put(1)
            try:
                f.result(timeout=CHILD_WAIT)
                out["dead"] = "no error"
            except KvTransferError as e:
                out["dead"] = ("KvTransferError", time.monotonic() - t0, str(e))
            except BaseException as e:  # noqa: BLE001
                out["dead"] = repr(e)
            # the broken epoch is refused at once; an older one too
            for ep in (7, 6):
                try:
                    recv.post("prefill0", ep, [8])
                    out[f"post{ep}"] = "accepted"
                except KvTransferError:
                    out[f"post{ep}"] = "refused"
            # 3. a restarted sender on epoch 8
            f = recv.post("prefill0", 8, [9, 4, 2])
            go2.put(0)
            f.result(timeout=CHILD_WAIT)
            out["restart"] = _check_landed(pool, _source_pool(3, "float32"), [0, 5, 1],
                                           [9, 4, 2], {1, 3, 9, 4, 2})
            recv.close()
            res_q.put(("ok", out))
    except BaseException as e:  # noqa: BLE001
        res_q.put(("error", repr(e)))


def test_sender_death_then_new_epoch(ctx):
    timeout = 3.0
    addr_q, res_d, res_1, res_2 = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    go1, go2 = ctx.Queue(), ctx.Queue()
    d = ctx.Process(target=_decode_restart_child, args=(addr_q, go1, go2, res_d, timeout))
    dtypes = {"decode0": "float32"}
    cfg1 = {"dtypes": dtypes, "epoch": 7, "sends": [("decode0", 7, 1, [0, 2])],
            "die_after_next_go": True, "timeout": timeout}
    cfg2 = {"dtypes": dtypes, "epoch": 8, "sends": [("decode0", 8, 3, [0, 5, 1])],
            "timeout": timeout}
    p1 = ctx.Process(target=_prefill_child, args=(cfg1, "prefill0", addr_q, go1, res_1))
    p2 = ctx.Process(target=_prefill_child, args=(cfg2, "prefill0", addr_q, go2, res_2))
    for p in (d, p1, p2):
        p.start()
    try:
        _get(res_1, "prefill 1")
        _get(res_2, "prefill 2 (restarted)")
        _, out = _get(res_d, "decode")
    finally:
        _reap(p1, p2, d)
    assert out["first"] == []
    assert out["dead"][0] == "KvTransferError", out["dead"]
    assert out["dead"][1] < timeout + 2.0, out["dead"]
    assert out["post7"] == "refused" and out["post6"] == "refused"
    assert out["restart"] == []


def _decode_timeout_child(addr_q, go, back, res_q, timeout: float) -> None:
    try:
        torch.set_num_threads(1)
        with KvStoreServer("127.0.0.1", 0) as server:
            addr_q.put(server.address)
            pool = _poisoned_pool("float32")
            recv = KvReceiver(pool, "decode0", server, timeout=timeout)
            out = {}
            f = recv.post("p", 1, [2])
            go.put("send")
            f.result(timeout=CHILD_WAIT)
            t0 = time.monotonic()
            f = recv.post("p", 1, [4])
            go.put("skip")         # the sender is alive but does not send
            try:
                f.result(timeout=CHILD_WAIT)
                out["stalled"] = "no error"
            except KvTransferError as e:
                out["stalled"] = ("KvTransferError", time.monotonic() - t0, str(e))
            go.put("failed")
            epoch = back.get(timeout=CHILD_WAIT)   # the sender's next epoch (after mark_broken)
            f = recv.post("p", epoch, [6, 0])
            go.put("send")
            f.result(timeout=CHILD_WAIT)
            out["after"] = _check_landed(pool, _source_pool(9, "float32"), [1, 2], [6, 0],
                                         {2, 6, 0})
            recv.close()
            res_q.put(("ok", out))
    except BaseException as e:  # noqa: BLE001
        res_q.put(("error", repr(e)))


def _prefill_timeout_child(addr_q, go, back, res_q, timeout: float) -> None:
    try:
        torch.set_num_threads(1)
        addr = addr_q.get(timeout=CHILD_WAIT)
        sender = KvSender("p", timeout=timeout, first_epoch=1)
        pool = _source_pool(9, "float32")
        assert go.get(timeout=CHILD_WAIT) == "send"
        sender.send_blocks("decode0", addr, 1, pool, [0])
        assert go.get(timeout=CHILD_WAIT) == "skip"
        assert go.get(timeout=CHILD_WAIT) == "failed"  # the receiver timed out
        # e.g. the PushKV answer was lost: the worker gives up on this epoch
        epoch = sender.mark_broken("decode0", "PushKV outcome unknown")
        back.put(epoch)
        assert go.get(timeout=CHILD_WAIT) == "send"
        sender.send_blocks("decode0", addr, epoch, pool, [1, 2])
        sender.close()
        res_q.put(("ok", epoch))
    except BaseException as e:  # noqa: BLE001
        res_q.put(("error", repr(e)))


def test_receive_timeout_then_new_epoch(ctx):
    timeout = 3.0
    addr_q, res_d, res_p, go, back = (ctx.Queue() for _ in range(5))
    d = ctx.Process(target=_decode_timeout_child, args=(addr_q, go, back, res_d, timeout))
    p = ctx.Process(target=_prefill_timeout_child, args=(addr_q, go, back, res_p, timeout))
    d.start(), p.start()
    try:
        _, epoch = _get(res_p, "prefill")
        _, out = _get(res_d, "decode")
    finally:
        _reap(p, d)
    assert epoch == 2
    assert out["stalled"][0] == "KvTransferError", out["stalled"]
    assert out["stalled"][1] < timeout + 2.0, out["stalled"]
    assert out["after"] == []


# ------------------------------------------------------------------ (5) single process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    src = torch.randn(NUM_BLOCKS, *GEOM, generator=g).to(dtype)
    ids = [7, 2, 19, 3, 11]
    gathered = gather_blocks(src, ids)
    assert gathered.shape == (len(ids), *GEOM) and gathered.is_contiguous()
    for i, b in enumerate(ids):
        assert _same_bits(gathered[i], src[b])
    # into a reusable (larger) staging buffer
    staging = torch.empty(10 * src[0].numel(), dtype=dtype)
    out = gather_blocks(src, ids, out=staging)
    assert out.data_ptr() == staging.data_ptr() and _same_bits(out, gathered)
    with pytest.raises(KvTransferError):
        gather_blocks(src, ids, out=torch.empty(3, dtype=dtype))
    dst = torch.full_like(src, POISON)
    dst_ids = [0, 23, 5, 6, 12]
    scatter_blocks(dst, dst_ids, gathered)
    assert _check_landed(dst, src, ids, dst_ids, set(dst_ids)) == []
    # tensor ids work too
    scatter_blocks(dst, torch.tensor([1]), gather_blocks(src, torch.tensor([4])))
    assert _same_bits(dst[1], src[4])


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
    assert _check_landed(dst, src, ids, dst_ids, set(dst_ids)) == []


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
    src = _source_pool(5, dtype)
    dst = _poisoned_pool(dtype)
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
        assert _check_landed(dst, src, src_ids, dst_ids, set(dst_ids)) == []
        with pytest.raises(KvTransferError):   # a first token needs a block to follow
            sender.send_blocks("d", server.address, 1, src, [], first_token=token)
        sender.close()
        recv.close()


def test_in_process_sends_started_before_the_previous_one_crossed():
    """start_send returns once a send is enqueued; several can be started in PushKV order and
    waited afterwards (Gloo: each start waits for the pair's previous send itself)."""
    src = _source_pool(6, "bfloat16")
    dst = _poisoned_pool("bfloat16")
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
        assert _check_landed(dst, src, [i for s, _ in transfers for i in s],
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
        assert _check_landed(dst, src, [i for s, _ in transfers for i in s],
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
