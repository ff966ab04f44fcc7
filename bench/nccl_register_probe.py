"""Does NCCL buffer registration speed up one KV transfer? (2 GPUs, a question for the device.)

Two processes (rank 0 sends from GPU 0, rank 1 receives on GPU 1) over one ``PairChannel``.
Each side holds two buffers of the same size: one from the caching allocator (what the KV pool
is today) and one from the process group's NCCL allocator (``ncclMemAlloc``), registered with
the pair communicator (``register_mem_pool``). For each buffer kind and message size, every
trial: the receiver posts its receive and signals the sender over a pipe; the sender records a
CUDA event, sends, records another, and reports the interval (the receive is already waiting,
so it is the wire time of one message from idle). Also a back-to-back loop of 10 sends.
Checks bit-exactness of the last message.

  python -m bench.nccl_register_probe --sizes-mib 112,448 --out /tmp/reg.json
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def _registered_buffer(pg, dev, numel: int):
    """A uint8 buffer from the NCCL allocator, registered with ``pg``; (None, why) if the
    torch build cannot."""
    import torch
    backend = pg
    if not hasattr(backend, "mem_allocator") and hasattr(pg, "_get_backend"):
        backend = pg._get_backend(dev)
    alloc = getattr(backend, "mem_allocator", None)
    if alloc is None or not hasattr(torch.cuda, "MemPool"):
        return None, "no mem_allocator / MemPool in this torch"
    pool = torch.cuda.MemPool(alloc)
    with torch.cuda.use_mem_pool(pool):
        buf = torch.empty(numel, dtype=torch.uint8, device=dev)
    backend.register_mem_pool(pool)
    return (buf, pool), ""


def _run(rank: int, args: dict, conn, addr_q, out_q) -> None:
    try:
        import torch

        from bench.common import gpu_pair_channel
        dev, ch, _store = gpu_pair_channel(rank, addr_q, "reg", timeout=20)
        max_bytes = max(args["sizes"])
        plain = torch.empty(max_bytes, dtype=torch.uint8, device=dev)
        reg, why = _registered_buffer(ch._pg, dev, max_bytes)
        kinds = {"caching_allocator": plain}
        if reg is not None:
            kinds["nccl_registered"] = reg[0]
        if rank == 0:
            for buf in kinds.values():
                buf.copy_(torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=dev,
                                        generator=torch.Generator(dev).manual_seed(1)))
        torch.cuda.synchronize()
        rows = []
        for kind, buf in kinds.items():
            for nbytes in args["sizes"]:
                view = buf[:nbytes]
                single, loop = [], None
                for trial in range(args["trials"] + 1):
                    if rank == 1:
                        op = ch.irecv(view)
                        conn.send("posted")
                        ch.synchronize([op], time.monotonic() + 20)
                        conn.recv()
                    else:
                        conn.recv()
                        time.sleep(0.002)            # the receive kernel is surely waiting
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record(ch.stream)
                        op = ch.isend(view)
                        with torch.cuda.stream(ch.stream):
                            op.work.wait()
                        e.record(ch.stream)
                        ch.synchronize([op], time.monotonic() + 20)
                        e.synchronize()
                        if trial:                    # the first one warms up
                            single.append(s.elapsed_time(e))
                        conn.send("done")
                # back-to-back: 10 messages in a row
                if rank == 1:
                    ops = [ch.irecv(view) for _ in range(10)]
                    conn.send("posted")
                    ch.synchronize(ops, time.monotonic() + 30)
                    conn.recv()
                else:
                    conn.recv()
                    time.sleep(0.002)
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(ch.stream)
                    ops = [ch.isend(view) for _ in range(10)]
                    with torch.cuda.stream(ch.stream):
                        for op in ops:
                            op.work.wait()
                    e.record(ch.stream)
                    ch.synchronize(ops, time.monotonic() + 30)
                    e.synchronize()
                    loop = s.elapsed_time(e) / 10
                    conn.send("done")
                if rank == 0:
                    med = statistics.median(single)
                    rows.append({"buffer": kind, "bytes": nbytes, "single_median_ms": med,
                                 "single_min_ms": min(single), "single_GBps": nbytes / med / 1e6,
                                 "loop_ms": loop, "loop_GBps": nbytes / loop / 1e6})
                    print(f"{kind:>18} {nbytes / 2**20:8.1f} MiB  one {med:.3f} ms "
                          f"({nbytes / med / 1e6:.0f} GB/s)  loop {loop:.3f} ms "
                          f"({nbytes / loop / 1e6:.0f} GB/s)", flush=True)
        exact = None
        if rank == 1:
            ref = torch.randint(0, 256, (max_bytes,), dtype=torch.uint8, device=dev,
                                generator=torch.Generator(dev).manual_seed(1))
            exact = {k: bool(torch.equal(b[:args["sizes"][-1]], ref[:args["sizes"][-1]]))
                     for k, b in kinds.items()}
        ch.close()
        out_q.put((rank, {"rows": rows, "registered": reg is not None, "why_not": why,
                          "bit_exact": exact}))
    except BaseException as e:  # noqa: BLE001
        import traceback
        out_q.put((rank, f"{e!r}\n{traceback.format_exc()}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes-mib", default="112,448")
    p.add_argument("--trials", type=int, default=15)
    p.add_argument("--out", default="bench/results/nccl_register_probe.json")
    a = p.parse_args(argv)
    args = {"sizes": [int(float(s) * 2**20) for s in a.sizes_mib.split(",")], "trials": a.trials}
    ctx = mp.get_context("spawn")
    c0, c1 = ctx.Pipe()
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, args, c, addr_q, out_q)) for r, c in ((0, c0), (1, c1))]
    for pr in procs:
        pr.start()
    results: dict = {}
    try:
        while len(results) < 2:
            rank, value = out_q.get(timeout=300)
            results[rank] = value
            if isinstance(value, str):
                break
    finally:
        for pr in procs:
            pr.join(20)
            if pr.is_alive():
                pr.kill()
    for r, v in results.items():
        if isinstance(v, str):
            print(f"rank {r} failed:\n{v}")
            return 1
    report = {"benchmark": "nccl_register_probe", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "git_commit": os.environ.get("PDSERVE_GIT_COMMIT"),
              "command": "python -m bench.nccl_register_probe " + " ".join(sys.argv[1:] if argv is None else argv),
              "registered": results[0]["registered"], "why_not": results[0]["why_not"],
              "bit_exact": results[1]["bit_exact"], "rows": results[0]["rows"]}
    print(json.dumps({k: report[k] for k in ("registered", "why_not", "bit_exact")}))
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
