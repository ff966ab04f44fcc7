"""Where the time of one KV transfer goes: NCCL data-path variants side by side (2 GPUs).

Two processes (rank 0 sends from GPU 0, rank 1 receives on GPU 1) over one ``PairChannel``.
For each strategy and size, every trial: the receiver enqueues its side (the receive is
posted before the sender starts, as PushKV does), signals the sender over a pipe; the sender
synchronises its device, takes ``t0``, enqueues its side and spins on its completion event;
the receiver spins on its own completion event (``t1``). Reported: ``t1 - t0`` (median, p90),
the host time each side spends enqueueing, GPU intervals from CUDA events (``send_gpu_ms``:
the sender's stream from its start -- after the stand-in prefill step with ``--ahead-cycles``
-- to its side done; ``scatter_gpu_ms``: the receiver's scatter after the data landed), and
bit-exactness of the landed blocks.

Strategies (scattered = random block ids on both sides):
* ``contig``      one message, contiguous ids on both sides (the wire alone);
* ``one``         gather into staging -> one message -> scatter (the current data path);
* ``grouped``     one NCCL group of per-block sends / receives, straight from / into the pool
                  (no staging, no copies);
* ``pipeN``       N messages; gather of chunk i+1 and scatter of chunk i overlap the wire.

  python -m bench.kv_probe --sizes 16,1024,4096 --out /tmp/probe.json

Known problem of this probe (not of the transfer path): with the strategy order
``contig,one`` the first ``one`` trial hung on 2xH200 (the receive was posted, the send never
issued; the order ``contig,grouped,one,...`` ran). Use ``--strategies`` in that order.
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

GEOM = (28, 2, 16, 8, 128)   # layers, K/V, block size, kv heads, head dim (Qwen3-0.6B)
_PHASES: list = []           # host seconds between the marks of each _enqueue call


def _pool(dev, num_blocks: int, seed: int | None):
    import torch
    if seed is None:
        return torch.zeros(num_blocks, *GEOM, dtype=torch.bfloat16, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(num_blocks, *GEOM, dtype=torch.bfloat16, device=dev, generator=g)


def _plan(sizes, num_blocks: int, trials: int) -> list[dict]:
    rng = random.Random(0)
    plan = []
    for tokens in sizes:
        n = max(1, tokens // GEOM[2])
        for t in range(trials):
            plan.append({"tokens": tokens, "n": n, "trial": t,
                         "src": rng.sample(range(num_blocks), n),
                         "dst": rng.sample(range(num_blocks), n),
                         "start": rng.randrange(0, num_blocks - n + 1)})
    return plan


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    k = max(1, min(k, n))
    per = -(-n // k)
    return [(s, min(s + per, n)) for s in range(0, n, per)]


def _enqueue(rank: int, strategy: str, ch, pool, item: dict, staging, gpu: dict | None = None):
    """Enqueue this rank's side of one transfer on ``ch.stream``; returns the completion event.
    ``gpu``: filled with timing events (``landed``: receiver, after the receives, before the
    scatter) for GPU-side intervals."""
    import torch

    from pdserve.common.kv_transfer.channel import _wire
    dev = pool.device
    s = ch.stream
    gpu = {} if gpu is None else gpu
    ids = item["src"] if rank == 0 else item["dst"]
    n = item["n"]
    marks = [time.perf_counter()]
    with torch.cuda.stream(s):
        idx = torch.tensor(ids, dtype=torch.long).pin_memory().to(dev, non_blocking=True)
        marks.append(time.perf_counter())
        if strategy == "contig":
            view = pool[item["start"]:item["start"] + n]
            op = ch.isend(view) if rank == 0 else ch.irecv(view)
            marks.append(time.perf_counter())
            op.work.wait()
        elif strategy == "grouped":
            pg = ch._pg
            pg._start_coalescing()
            for b in ids:
                if rank == 0:
                    pg.send([_wire(pool[b])], 1, 0)
                else:
                    pg.recv([_wire(pool[b])], 0, 0)
            pg._end_coalescing().wait()
        else:
            k = 1 if strategy == "one" else int(strategy[4:])
            parts = _chunks(n, k)
            buf = staging[:n]
            if rank == 0:
                ops = []
                for a, b in parts:
                    torch.index_select(pool, 0, idx[a:b], out=buf[a:b])
                    ops.append(ch.isend(buf[a:b]))
                for op in ops:   # the sends run on the group's stream: order the event after
                    op.work.wait()
            else:
                ops = [ch.irecv(buf[a:b]) for a, b in parts]   # all posted first
                for i, ((a, b), op) in enumerate(zip(parts, ops)):
                    op.work.wait()                              # stream waits, no host block
                    if i == 0:
                        gpu["landed"] = torch.cuda.Event(enable_timing=True)
                        gpu["landed"].record(s)
                    pool.index_copy_(0, idx[a:b], buf[a:b])
        marks.append(time.perf_counter())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(s)
    _PHASES.append([b - a for a, b in zip(marks, marks[1:])])
    return ev


def _run(rank: int, args: dict, plan: list[dict], conn, addr_q, out_q) -> None:
    try:
        import torch

        from bench.common import gpu_pair_channel
        dev, ch, _store = gpu_pair_channel(rank, addr_q, "probe", timeout=15)
        nb = args["num_blocks"]
        pool = _pool(dev, nb, 7 if rank == 0 else None)
        ref = _pool(dev, nb, 7) if rank == 1 else None
        max_n = max(item["n"] for item in plan)
        staging = torch.empty(max_n, *GEOM, dtype=torch.bfloat16, device=dev)
        torch.cuda.synchronize()
        rows = []
        strategies = [s for s in args["strategies"]
                      if s != "grouped" or hasattr(ch._pg, "_start_coalescing")]
        for strategy in strategies:
            for item in plan:
                if rank == 1:
                    pool.zero_()
                    torch.cuda.synchronize()
                    h0 = time.perf_counter()
                    gpu: dict = {}
                    ev = _enqueue(1, strategy, ch, pool, item, staging, gpu)
                    h1 = time.perf_counter()
                    conn.send("go")
                    while not ev.query():
                        if time.perf_counter() - h1 > 20:
                            raise TimeoutError(f"{strategy} {item['tokens']} tokens never landed")
                    t1 = time.perf_counter()
                    t0, s_enq, s_done, send_gpu_ms = conn.recv()
                    scatter_gpu_ms = (gpu["landed"].elapsed_time(ev) if "landed" in gpu
                                      else 0.0)
                    ok = None
                    if item["trial"] == args["trials"] - 1:
                        if strategy == "contig":
                            got = pool[item["start"]:item["start"] + item["n"]]
                            want = ref[item["start"]:item["start"] + item["n"]]
                        else:
                            got = pool[torch.tensor(item["dst"], device=dev)]
                            want = ref[torch.tensor(item["src"] if strategy != "contig" else
                                                    item["dst"], device=dev)]
                        ok = bool(torch.equal(got, want))
                    rows.append({"strategy": strategy, "tokens": item["tokens"],
                                 "trial": item["trial"], "ms": (t1 - t0) * 1e3,
                                 "recv_enqueue_ms": (h1 - h0) * 1e3,
                                 "send_enqueue_ms": s_enq * 1e3, "send_done_ms": s_done * 1e3,
                                 "send_gpu_ms": send_gpu_ms, "scatter_gpu_ms": scatter_gpu_ms,
                                 "bit_exact": ok})
                else:
                    conn.recv()
                    torch.cuda.synchronize()
                    start = torch.cuda.Event(enable_timing=True)
                    if args["ahead_cycles"]:   # the send is enqueued while a step still runs
                        torch.cuda._sleep(args["ahead_cycles"])
                        ch.stream.wait_stream(torch.cuda.current_stream())
                    start.record(ch.stream)
                    t0 = time.perf_counter()
                    ev = _enqueue(0, strategy, ch, pool, item, staging)
                    t_enq = time.perf_counter()
                    while not ev.query():
                        pass
                    t_done = time.perf_counter()
                    conn.send((t0, t_enq - t0, t_done - t0, start.elapsed_time(ev)))
                    if item["trial"] == args["trials"] - 1:
                        ph = [[round(x * 1e3, 3) for x in p] for p in _PHASES[-5:]]
                        print(f"rank 0 {strategy} {item['tokens']}: enqueue phases ms {ph}",
                              flush=True)
        ch.close()
        out_q.put((rank, rows))
    except BaseException as e:  # noqa: BLE001
        import traceback
        msg = f"{e!r}\n{traceback.format_exc()}"
        print(f"rank {rank} failed: {msg}", file=sys.stderr, flush=True)
        out_q.put((rank, msg))


def _summary(rows: list[dict], warmup: int) -> list[dict]:
    out = []
    keys = sorted({(r["strategy"], r["tokens"]) for r in rows}, key=lambda k: (k[1], k[0]))
    for strategy, tokens in keys:
        rs = [r for r in rows if r["strategy"] == strategy and r["tokens"] == tokens
              and r["trial"] >= warmup]
        ms = sorted(r["ms"] for r in rs)
        med = statistics.median(ms)
        nbytes = tokens * 114_688
        out.append({"strategy": strategy, "tokens": tokens, "median_ms": med,
                    "p90_ms": ms[int(0.9 * (len(ms) - 1))], "GBps": nbytes / med / 1e6,
                    "send_enqueue_ms": statistics.median(r["send_enqueue_ms"] for r in rs),
                    "send_done_ms": statistics.median(r["send_done_ms"] for r in rs),
                    "recv_enqueue_ms": statistics.median(r["recv_enqueue_ms"] for r in rs),
                    "send_gpu_ms": statistics.median(r["send_gpu_ms"] for r in rs),
                    "scatter_gpu_ms": statistics.median(r["scatter_gpu_ms"] for r in rs),
                    "bit_exact": all(r["bit_exact"] for r in rs if r["bit_exact"] is not None)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,1024,4096")
    p.add_argument("--strategies", default="contig,one,grouped,pipe2,pipe4")
    p.add_argument("--trials", type=int, default=23)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--ahead-cycles", type=int, default=0,
                   help="enqueue the sender's side behind a GPU sleep of this many cycles (the "
                        "prefill step still running); send_gpu_ms then starts when it ends")
    p.add_argument("--out", default="bench/results/kv_probe.json")
    a = p.parse_args(argv)
    args = {"strategies": a.strategies.split(","), "trials": a.trials,
            "num_blocks": a.num_blocks, "ahead_cycles": a.ahead_cycles}
    plan = _plan([int(s) for s in a.sizes.split(",")], a.num_blocks, a.trials)
    ctx = mp.get_context("spawn")
    c0, c1 = ctx.Pipe()
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_run, args=(r, args, plan, c, addr_q, out_q))
             for r, c in ((0, c0), (1, c1))]
    for pr in procs:
        pr.start()
    results: dict = {}
    while len(results) < 2:
        rank, value = out_q.get(timeout=900)
        results[rank] = value
        if isinstance(value, str):     # one side failed: the other may be stuck in NCCL
            for pr in procs:
                pr.terminate()
            break
    for pr in procs:
        pr.join(30)
    for r in (0, 1):
        if isinstance(results.get(r), str):
            print(f"rank {r} failed:\n{results[r]}")
            return 1
    summary = _summary(results[1], a.warmup)
    print(f"{'strategy':>9} {'tokens':>6} {'med ms':>7} {'p90 ms':>7} {'GB/s':>6} "
          f"{'s_enq':>6} {'s_done':>6} {'r_enq':>6} {'s_gpu':>6} {'scat':>6} exact")
    for s in summary:
        print(f"{s['strategy']:>9} {s['tokens']:>6} {s['median_ms']:7.3f} {s['p90_ms']:7.3f} "
              f"{s['GBps']:6.1f} {s['send_enqueue_ms']:6.3f} {s['send_done_ms']:6.3f} "
              f"{s['recv_enqueue_ms']:6.3f} {s['send_gpu_ms']:6.3f} {s['scatter_gpu_ms']:6.3f} "
              f"{s['bit_exact']}")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"benchmark": "kv_probe", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "git_commit": os.environ.get("PDSERVE_GIT_COMMIT"),
                   "command": "python -m bench.kv_probe " + " ".join(sys.argv[1:] if argv is None else argv),
                   "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
