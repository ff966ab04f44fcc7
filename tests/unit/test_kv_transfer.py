"""KV transfer on CPU (Gloo) between real processes (multiprocessing 'spawn'): the ordered
sender/receiver protocol, two senders to one receiver, peer death and receive timeouts followed
by a new epoch. Single-process pieces (gather/scatter, chunk plans, pair channels):
test_kv_transfer_local.py.

The child processes report plain Python values through multiprocessing queues (never tensors).
The PushKV control call is played by a queue: the decode child posts its receive, then tells
the prefill child to send.
"""

import contextlib
import multiprocessing as mp
import os
import queue
import time
from collections.abc import Iterator

import pytest
import torch
from kv_pools import NUM_BLOCKS, check_landed, poisoned_pool, same_bits, source_pool

from pdserve.common.kv_transfer import (
    KvReceiver,
    KvSender,
    KvStoreServer,
    KvTransferError,
    bytes_per_block,
)

CHILD_WAIT = 30.0  # seconds a test waits for a child's answer before failing

pytestmark = pytest.mark.timeout(120)


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
                pools[did] = poisoned_pool(dtype)
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
                src = source_pool(seed, cfg["dtypes"][did])
                results.append((nbytes, check_landed(pools[did], src, src_ids, dst_ids,
                                                      touched[did])))
            # all transfers done: check again that no later transfer disturbed an earlier one
            final = []
            for _pid, did, _epoch, seed, src_ids, dst_ids in cfg["plan"]:
                src = source_pool(seed, cfg["dtypes"][did])
                final += [f"{did} block {d} overwritten" for s, d in zip(src_ids, dst_ids)
                          if not same_bits(pools[did][d], src[s])]
            for did, pool in pools.items():
                final += check_landed(pool, pool, [], [], touched[did])
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
            pool = source_pool(seed, cfg["dtypes"][did])
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
           "max_message_bytes": {did: 2 * bytes_per_block(poisoned_pool(dt))
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
    bb = {did: bytes_per_block(poisoned_pool(dt)) for did, dt in dtypes.items()}
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
@contextlib.contextmanager
def _decode0_receiver(addr_q, timeout: float) -> Iterator[tuple[torch.Tensor, KvReceiver]]:
    """Worker ``decode0``'s float32 poisoned pool and its receiver (``timeout`` s) on a new store
    server, whose address goes to ``addr_q``; the server stops on leaving."""
    torch.set_num_threads(1)
    with KvStoreServer("127.0.0.1", 0) as server:
        addr_q.put(server.address)
        pool = poisoned_pool("float32")
        yield pool, KvReceiver(pool, "decode0", server, timeout=timeout)


def _decode_restart_child(addr_q, go1, go2, res_q, timeout: float) -> None:
    try:
        with _decode0_receiver(addr_q, timeout) as (pool, recv):
            out = {}
            # 1. a normal transfer on epoch 7
            f = recv.post("prefill0", 7, [3, 1])
            go1.put(0)
            f.result(timeout=CHILD_WAIT)
            out["first"] = check_landed(pool, source_pool(1, "float32"), [0, 2], [3, 1],
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
            out["restart"] = check_landed(pool, source_pool(3, "float32"), [0, 5, 1],
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
        with _decode0_receiver(addr_q, timeout) as (pool, recv):
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
            out["after"] = check_landed(pool, source_pool(9, "float32"), [1, 2], [6, 0],
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
        pool = source_pool(9, "float32")
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
