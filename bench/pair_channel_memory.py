"""Lab: GPU memory one NCCL pair channel costs (2 GPUs, e.g. nvidia-h200-x2).

    python -m bench.pair_channel_memory --channels 1,2,4,8 --out bench/results/pair_channel_memory.json

Two processes (GPU 0 = the prefill side, rank 0; GPU 1 = the decode side, rank 1) form N pair
channels (pdserve.common.kv_transfer.PairChannel: one 2-rank ProcessGroupNCCL each, over one TCPStore)
and send one small message on each, so every communicator is fully set up. Before and after,
each process records ``torch.cuda.memory_reserved`` (the caching allocator: NCCL's own buffers
are not in it) and ``torch.cuda.mem_get_info`` (device-wide used memory, which includes NCCL's
buffers and CUDA contexts); ``nvidia-smi`` per-GPU used memory is recorded as well. The figure
per channel is (used after N - used after 0) / N per GPU; what is not given back once all are
closed is reported per channel as well. Set NCCL env vars (NCCL_BUFFSIZE, NCCL_NCHANNELS_PER_NET_PEER,
...) before running to see their effect; the NCCL_* variables set are recorded.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time


def _smi() -> list[int]:
    try:
        out = subprocess.check_output(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      text=True, timeout=20)
        return [int(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def _used(torch) -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _bandwidth(ch, rank: int, torch, mib: int, reps: int = 10) -> float:
    """GB/s of ``reps`` sends of ``mib`` MiB over ``ch`` (rank 0 sends, rank 1 receives)."""
    x = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    io = ch.send if rank == 0 else ch.recv
    io(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        io(x)
    torch.cuda.synchronize()
    return reps * x.numel() / (time.perf_counter() - t0) / 1e9


def _cycles(rank: int, store_port: int, n: int, torch, t) -> list[int]:
    """Device memory used after each of ``n`` open-send-close cycles of one more channel."""
    from pdserve.common.kv_transfer import PairChannel
    used = []
    for k in range(n):
        ch = PairChannel(f"127.0.0.1:{store_port}", "p", "d", 1000 + k, rank, "cuda", timeout=120)
        (ch.send if rank == 0 else ch.recv)(t)
        torch.cuda.synchronize()
        ch.close()
        torch.cuda.synchronize()
        time.sleep(0.5)
        used.append(_used(torch))
    return used


def _side(rank: int, store_port: int, counts: list[int], q, bandwidth_mib: int, cycles: int) -> None:
    import torch

    from pdserve.common.kv_transfer import KvStoreServer, PairChannel
    torch.cuda.set_device(rank)
    torch.zeros(1, device="cuda")                       # the CUDA context first
    server = KvStoreServer("127.0.0.1", store_port) if rank == 1 else None
    time.sleep(0.5)
    t = torch.ones(1024, device="cuda")
    rows, chans = [], []
    for n in counts:
        while len(chans) < n:
            ch = PairChannel(f"127.0.0.1:{store_port}", "p", "d", len(chans) + 1, rank, "cuda", timeout=120)
            (ch.send if rank == 0 else ch.recv)(t)
            chans.append(ch)
        torch.cuda.synchronize()
        time.sleep(1.0)
        rows.append({"channels": n, "device_used_bytes": _used(torch),
                     "torch_reserved_bytes": torch.cuda.memory_reserved()})
        q.put(("step", rank, n))
    gbps = _bandwidth(chans[0], rank, torch, bandwidth_mib) if bandwidth_mib and chans else None
    for ch in chans:
        ch.close()
    torch.cuda.synchronize()
    time.sleep(2.0)
    rows.append({"channels": 0, "after_close_of": len(chans), "device_used_bytes": _used(torch),
                 "torch_reserved_bytes": torch.cuda.memory_reserved(), "first_channel_send_gbps": gbps,
                 "used_after_each_cycle": _cycles(rank, store_port, cycles, torch, t)})
    q.put(("rows", rank, rows))
    if server is not None:
        server.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", default="1,2,4,8,16")
    p.add_argument("--store-port", type=int, default=29611)
    p.add_argument("--out", default="bench/results/pair_channel_memory.json")
    p.add_argument("--bandwidth-mib", type=int, default=64, help="time sends of this size on the first channel")
    p.add_argument("--cycles", type=int, default=0, help="then open, use and close one channel this many times")
    args = p.parse_args(argv)
    counts = [0] + [int(x) for x in args.channels.split(",")]
    smi0 = _smi()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_side,
                          args=(r, args.store_port, counts, q, args.bandwidth_mib, args.cycles)) for r in (0, 1)]
    for pr in ps:
        pr.start()
    rows: dict[int, list] = {}
    smi: dict[int, list[int]] = {}
    steps: dict[int, int] = {}
    while len(rows) < 2:
        kind, rank, payload = q.get(timeout=600)
        if kind == "rows":
            rows[rank] = payload
        else:
            steps[payload] = steps.get(payload, 0) + 1
            if steps[payload] == 2:
                smi[payload] = _smi()
    for pr in ps:
        pr.join(60)
    import torch
    result = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python -m bench.pair_channel_memory " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": os.environ.get("PDSERVE_GIT_COMMIT", ""), "host": platform.node(),
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
              "counts": counts, "nvidia_smi_before_mib": smi0, "nvidia_smi_mib": smi, "per_rank": rows,
              "per_channel_bytes": {}}
    for rank, rr in rows.items():
        base, last, closed = rr[0], rr[-2], rr[-1]
        n = last["channels"] or 1
        result["per_channel_bytes"][f"rank{rank}"] = {
            "device_used": (last["device_used_bytes"] - base["device_used_bytes"]) / n,
            "torch_reserved": (last["torch_reserved_bytes"] - base["torch_reserved_bytes"]) / n,
            "not_returned_after_close": (closed["device_used_bytes"] - base["device_used_bytes"]) / n}
    print(json.dumps(result["per_channel_bytes"], indent=1))
    from pathlib import Path
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
