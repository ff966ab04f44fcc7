"""Child processes of the KV transfer benchmark (bench/kv_transfer.py) and the helpers only
they use.

``decode_proc`` (rank 1: the decode worker's ``KvReceiver``, hosting the ``KvStoreServer``)
and ``prefill_proc`` (rank 0: the prefill worker's ``KvSender``) are started by
``bench.kv_transfer.main`` with multiprocessing 'spawn'; they follow the schedule of
``bench.kv_transfer.make_schedule`` and report over the queues it passes them. Nothing here
imports bench.kv_transfer (its NCCL environment reaches these processes as inherited
environment variables).
"""
from __future__ import annotations

import os
import threading
import time

PREFILL_ID = "bench-prefill"
DECODE_ID = "bench-decode"
POISON_BITS = 0x40E0  # bf16 7.0 / the int16 pattern the receiver pool is filled with
WAIT = 120.0


# ---------------------------------------------------------------------------- helpers
def _device(args: dict, rank: int):
    import torch
    if args["device"] == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", rank)


def _bind(args: dict, rank: int):
    """This process's device (``cuda:rank``, or the CPU with ``--cpu-threads`` threads), made current."""
    import torch
    dev = _device(args, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(max(1, args["cpu_threads"]))
    return dev


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _dtype(name: str):
    import torch
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _geom(args: dict) -> tuple:
    return (args["layers"], 2, args["block_size"], args["kv_heads"], args["head_dim"])


def _verify_data(args: dict, n: int):
    """Deterministic random blocks (bit patterns), generated on the CPU: the same on both
    sides whatever the device."""
    import torch
    g = torch.Generator().manual_seed(1234)
    dt = _dtype(args["dtype"])
    numel = n * int(torch.Size(_geom(args)).numel())
    itemsize = torch.empty(0, dtype=dt).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=g, dtype=torch.uint8)
    t = raw.view(dt).view(n, *_geom(args))
    if dt.is_floating_point:  # keep clear of NaN payloads (bit-exact anyway, but tidy)
        t = torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0)
    return t


def _bits(t):
    import torch
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _first_token_of(i: int) -> tuple[int, float]:
    """The first token item ``i`` carries (the receiver checks it)."""
    return 1000 + i, -0.25 - i / 1024.0


def _wait_received(fut, dev):
    """Spin (yielding the GIL) until the receive future and its scatter event are done."""
    while not fut.done():
        time.sleep(0)
    got = fut.result()
    if got.event is not None:
        while not got.event.query():
            time.sleep(0)
    return got


# ---------------------------------------------------------------------------- processes
def decode_proc(args: dict, sched: dict, addr_q, go_q, t_q, res_q) -> None:
    """Rank 1: hosts the store, posts receives, times them, verifies data."""
    try:
        import torch

        from pdserve.common.kv_transfer import KvReceiver, KvStoreServer, KvTransferError
        dev = _bind(args, 1)
        server = KvStoreServer("127.0.0.1", 0)
        addr_q.put(server.address)
        dt = _dtype(args["dtype"])
        pool = torch.empty(args["num_blocks"], *_geom(args), dtype=dt, device=dev)
        _bits(pool).fill_(POISON_BITS if pool.element_size() == 2 else 0x40E00000)
        recv = KvReceiver(pool, DECODE_ID, server, timeout=args["timeout"],
                          max_message_bytes=args["max_message_bytes"])
        expected = _verify_data(args, args["verify_blocks"]).to(dev)
        poison_block = pool[0].clone()
        kind, epoch = t_q.get(timeout=WAIT)
        assert kind == "epoch"
        verify, timings = [], []
        for i, item in enumerate(sched["items"]):
            recv.max_message_bytes = item.get("max_message_bytes", args["max_message_bytes"])
            ahead = item.get("mode") == "ahead"
            fut = recv.post(PREFILL_ID, epoch, item["dst"], with_first_token=ahead)
            go_q.put(("go", i))
            if ahead:
                got = _wait_received(fut, dev)
            else:
                got = fut.result(timeout=WAIT)
                if got.event is not None:
                    got.event.synchronize()
            t1 = time.perf_counter()
            nbytes = got.num_bytes
            kind, j, t0, send_s, send_bytes = t_q.get(timeout=WAIT)
            assert kind == "sent" and j == i, (kind, j, i)
            assert nbytes == send_bytes
            if ahead:
                token_ok = got.first_token == _first_token_of(i)
                if not token_ok:
                    verify.append({"label": f"first token of item {i}", "bit_exact": False,
                                   "untouched_clean": True, "blocks": 0, "bytes": 0,
                                   "got": got.first_token, "want": _first_token_of(i)})
            if item["kind"] == "verify":
                verify.append(_check_verify_item(args, item, pool, expected, poison_block,
                                                 nbytes, dev))
            else:
                timings.append((i, t1 - t0, send_s, nbytes))
        recv.max_message_bytes = args["max_message_bytes"]
        failures = None
        if args["check_failures"]:
            failures = _decode_failure_checks(args, recv, pool, expected, epoch, go_q, t_q,
                                              KvTransferError)
        recv.close()
        server.close()
        res_q.put(("decode", {"verify": verify, "timings": timings, "failures": failures}))
    except BaseException as e:  # noqa: BLE001
        import traceback
        res_q.put(("error", f"decode: {e!r}\n{traceback.format_exc()}"))


def _check_verify_item(args: dict, item: dict, pool, expected, poison_block, nbytes: int,
                       dev) -> dict:
    """A verification item landed: its blocks bit-exact, every other block still poisoned;
    then puts the poison back into its blocks."""
    import torch
    src_idx = torch.tensor(item["src"], device=dev)
    dst_idx = torch.tensor(item["dst"], device=dev)
    exact = bool(torch.equal(_bits(pool.index_select(0, dst_idx)),
                             _bits(expected.index_select(0, src_idx))))
    mask = torch.ones(args["num_blocks"], dtype=torch.bool, device=dev)
    mask[dst_idx] = False
    untouched = pool[mask]
    clean = bool(torch.equal(_bits(untouched),
                             _bits(poison_block.expand_as(untouched))))
    checked = {"label": item["label"], "blocks": len(item["dst"]),
               "bytes": nbytes, "bit_exact": exact, "untouched_clean": clean}
    pool.index_copy_(0, dst_idx, poison_block.expand(len(item["dst"]),
                                                     *poison_block.shape))
    return checked


def _expect_failure(fut, t0: float, error_type) -> dict:
    """A posted receive that must fail with ``error_type`` (and how long it took since ``t0``)."""
    try:
        fut.result(timeout=WAIT)
        return {"ok": False, "error": "no error"}
    except error_type as e:
        return {"ok": True, "seconds": time.monotonic() - t0, "error": str(e)[:300]}


def _decode_failure_checks(args, recv, pool, expected, epoch, go_q, t_q, KvTransferError):
    import torch
    out = {}
    recv.timeout = args["failure_timeout"]
    dev = pool.device

    def landed(src, dst):
        return bool(torch.equal(_bits(pool[torch.tensor(dst, device=dev)]),
                                _bits(expected[torch.tensor(src, device=dev)])))

    # 1. a receive whose send never comes (the sender is alive): timeout, then a new epoch
    t0 = time.monotonic()
    fut = recv.post(PREFILL_ID, epoch, [1, 2, 3])
    go_q.put(("skip", -1))
    out["stalled"] = _expect_failure(fut, t0, KvTransferError)
    go_q.put(("failed", -1))
    kind, epoch2 = t_q.get(timeout=WAIT)
    fut = recv.post(PREFILL_ID, epoch2, [10, 12, 14])
    go_q.put(("verify", [4, 5, 6]))
    fut.result(timeout=WAIT)
    _sync(dev)
    out["new_epoch_after_timeout"] = {"epoch": epoch2, "bit_exact": landed([4, 5, 6],
                                                                             [10, 12, 14])}
    # 2. the sender process dies with a receive posted; a restarted sender (new process)
    t0 = time.monotonic()
    fut = recv.post(PREFILL_ID, epoch2, [20, 21])
    go_q.put(("die", -1))
    out["peer_death"] = _expect_failure(fut, t0, KvTransferError)
    kind, epoch3 = t_q.get(timeout=WAIT)   # from the restarted sender
    fut = recv.post(PREFILL_ID, epoch3, [30, 31, 33])
    go_q.put(("verify", [7, 8, 9]))
    fut.result(timeout=WAIT)
    _sync(dev)
    out["restarted_sender"] = {"epoch": epoch3, "bit_exact": landed([7, 8, 9], [30, 31, 33])}
    t_q.get(timeout=WAIT)  # the restarted sender is done
    return out


def prefill_proc(args: dict, sched: dict | None, addr_q, go_q, t_q, res_q,
                 first_epoch: int | None = None) -> None:
    """Rank 0: sends on each go. With sched None: the restarted sender of the failure
    checks (one verified transfer on a new epoch)."""
    try:
        import torch

        from pdserve.common.kv_transfer import KvSender
        dev = _bind(args, 0)
        addr = addr_q.get(timeout=WAIT)
        addr_q.put(addr)
        dt = _dtype(args["dtype"])
        pool = torch.empty(args["num_blocks"], *_geom(args), dtype=dt, device=dev)
        if dt.is_floating_point:
            pool.normal_()
        pool[:args["verify_blocks"]] = _verify_data(args, args["verify_blocks"]).to(dev)
        _sync(dev)
        sender = KvSender(PREFILL_ID, timeout=args["timeout"],
                          max_message_bytes=args["max_message_bytes"], first_epoch=first_epoch)
        t_q.put(("epoch", sender.next_epoch(DECODE_ID)))
        if sched is None:  # restarted sender
            kind, src = go_q.get(timeout=WAIT)
            sender.send_blocks(DECODE_ID, addr, sender.next_epoch(DECODE_ID), pool, src)
            t_q.put(("done", 0))
            sender.close()
            return
        info = {}
        for i, item in enumerate(sched["items"]):
            kind, j = go_q.get(timeout=WAIT)
            assert kind == "go" and j == i, (kind, j, i)
            sender.max_message_bytes = item.get("max_message_bytes", args["max_message_bytes"])
            _sync(dev)                      # the KV is ready
            if item.get("mode") == "ahead":
                t0, secs, nbytes = _send_ahead(args, sender, addr, pool, item["src"], i, dev)
            else:
                t0 = time.perf_counter()
                nbytes, secs = sender.send_blocks(DECODE_ID, addr,
                                                  sender.next_epoch(DECODE_ID), pool,
                                                  item["src"])
            t_q.put(("sent", i, t0, secs, nbytes))
        sender.max_message_bytes = args["max_message_bytes"]
        if args["check_failures"]:   # ends this process (os._exit) once done
            _prefill_failure_checks(args, sender, addr, pool, go_q, t_q, res_q, info)
        sender.close()
        res_q.put(("prefill", info))
    except BaseException as e:  # noqa: BLE001
        import traceback
        res_q.put(("error", f"prefill: {e!r}\n{traceback.format_exc()}"))


def _prefill_failure_checks(args: dict, sender, addr: str, pool, go_q, t_q, res_q,
                            info: dict) -> None:
    """The sender's side of ``_decode_failure_checks``: skips a send, starts a new epoch, sends
    one verified transfer, reports, then dies (``os._exit``) with a receive posted for it."""
    sender.timeout = args["failure_timeout"]
    kind, _ = go_q.get(timeout=WAIT)
    assert kind == "skip"
    kind, _ = go_q.get(timeout=WAIT)   # the receiver reports its failure
    assert kind == "failed"
    t_q.put(("epoch", sender.mark_broken(DECODE_ID, "PushKV outcome unknown")))
    kind, src = go_q.get(timeout=WAIT)
    sender.send_blocks(DECODE_ID, addr, sender.next_epoch(DECODE_ID), pool, src)
    info["epoch_after_mark_broken"] = sender.next_epoch(DECODE_ID)
    res_q.put(("prefill", info))
    res_q.close()
    res_q.join_thread()
    t_q.close()
    t_q.join_thread()
    kind, _ = go_q.get(timeout=WAIT)
    assert kind == "die"
    os._exit(0)   # a receive is posted for us: die without sending


def _send_ahead(args: dict, sender, addr: str, pool, src: list[int], i: int, dev):
    """Enqueue the send (blocks + first token) while a stand-in prefill step still runs on the
    GPU; returns (the moment that step's event fired, the sender's own seconds, bytes)."""
    import torch

    from pdserve.common.kv_transfer import FirstTokenRef
    token, logprob = _first_token_of(i)
    token_ids = torch.tensor([token], dtype=torch.int64, device=dev)
    logprobs = torch.tensor([logprob], dtype=torch.float32, device=dev)
    ready = None
    if dev.type == "cuda":
        torch.cuda._sleep(args["ahead_cycles"])      # the prefill step, still running
        ready = torch.cuda.Event()
        ready.record()
    result: dict = {}

    def send() -> None:
        try:
            result["out"] = sender.send_blocks(
                DECODE_ID, addr, sender.next_epoch(DECODE_ID), pool, src, ready_event=ready,
                first_token=FirstTokenRef(token_ids, logprobs, 0))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            result["error"] = e

    if ready is None:
        t0 = time.perf_counter()
        send()
    else:
        thread = threading.Thread(target=send)
        thread.start()
        while not ready.query():
            time.sleep(0)
        t0 = time.perf_counter()
        thread.join()
    if "error" in result:
        raise result["error"]
    nbytes, secs = result["out"]
    return t0, secs, nbytes
