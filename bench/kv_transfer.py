"""KV transfer benchmark: prefill (GPU 0) -> decode (GPU 1) over a NCCL pair channel.

Two processes (multiprocessing 'spawn'): rank 0 is the prefill worker's sender
(``KvSender``), rank 1 the decode worker's receiver (``KvReceiver``), which hosts the
``KvStoreServer``. A queue plays PushKV: the decode side posts its receive, then tells the
sender to go. Geometry defaults to Qwen3-0.6B (28 layers, 8 KV heads, head_dim 128, bf16,
block size 16: 114,688 bytes of KV per token).

Measured, per request size (tokens):
* effective bandwidth = bytes / (time from before the gather on the sender, with the KV
  ready, to the scatter complete on the receiver, i.e. its event synchronised); both
  timestamps are ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for the whole host);
  median over the trials, for scattered block ids (gather + send + recv + scatter) and for
  contiguous ids on both sides (sent from and received into the pool directly);
* the sender's own wall time (``send_blocks``);
* "ahead" (CUDA; what a prefill worker does): the send, with the first token at the end of
  the last message, is enqueued while the prefill step still runs (played by a ``torch.cuda._sleep``
  on the sender's stream, ``--ahead-cycles``), ordered on the GPU after that step's event, with
  the receive posted before; the interval is from that event firing (seen by the sender's host
  polling it) to the scatter complete on the receiver (its host polling the event), scattered
  block ids;
* handover latency of one request (default 1024 tokens, scattered ids): the "ahead" interval
  (the served path), p50 / p99 over ``--handover-trials``; and the same with the send started
  only once the KV is ready (``handover_after_ready``).

Before timing, it checks bit-exactness on random data (scattered ids, a chunked transfer,
contiguous ids; untouched blocks must keep their poison). ``--check-failures`` then checks
recovery: a receive whose send never comes fails within the timeout and a new epoch works;
the sender process dies with a receive posted, the receiver fails it (and survives), and a
restarted sender on a new epoch works.

  python bench/kv_transfer.py                         # 2 GPUs, NCCL
  python bench/kv_transfer.py --device cpu            # Gloo on the CPU, small sizes
Writes a table to stdout and JSON to --out (default bench/results/kv_transfer.json).
"""
from __future__ import annotations

import os

# NVLink multicast stays off on the lent machines (before torch or NCCL start).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.kv_transfer_procs import decode_proc, prefill_proc  # noqa: E402


# ---------------------------------------------------------------------------- helpers
def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_schedule(args: dict) -> dict:
    """Every transfer both sides run, in order (both processes get the same list)."""
    rng = random.Random(0)
    bs = args["block_size"]
    nb = args["num_blocks"]
    vb = args["verify_blocks"]
    sched = []

    def scattered(n, lo=0, hi=nb):
        src = rng.sample(range(lo, hi), n)
        dst = rng.sample(range(nb), n)
        return src, dst

    # verification (bit-exact): scattered, chunked, contiguous
    src, dst = scattered(vb, 0, vb)
    sched.append({"kind": "verify", "label": "scattered", "src": src, "dst": dst})
    src, dst = scattered(vb, 0, vb)
    sched.append({"kind": "verify", "label": "chunked", "src": src, "dst": dst,
                  "max_message_bytes": max(1, args["verify_chunk_bytes"])})
    sched.append({"kind": "verify", "label": "contiguous", "src": list(range(vb)),
                  "dst": list(range(nb - vb, nb))})
    src, dst = scattered(vb, 0, vb)
    sched.append({"kind": "verify", "label": "ahead, first token", "mode": "ahead",
                  "src": src, "dst": dst})
    for tokens in args["sizes"]:
        n = -(-tokens // bs)
        for mode in MODES:
            for t in range(args["warmup"] + args["trials"]):
                if mode == "contiguous":
                    src, dst = list(range(n)), list(range(nb - n, nb))
                else:
                    src, dst = scattered(n)
                sched.append({"kind": "bench", "tokens": tokens, "mode": mode,
                              "warmup": t < args["warmup"], "src": src, "dst": dst})
    n = -(-args["handover_tokens"] // bs)
    for mode in ("ahead", "scattered"):
        for t in range(args["warmup"] + args["handover_trials"]):
            src, dst = scattered(n)
            sched.append({"kind": "handover", "tokens": args["handover_tokens"], "mode": mode,
                          "warmup": t < args["warmup"], "src": src, "dst": dst})
    return {"items": sched}


MODES = ("scattered", "contiguous", "ahead")


# ---------------------------------------------------------------------------- main
def _git_commit(override: str | None = None) -> str | None:
    if override:
        return override
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except Exception:  # noqa: BLE001
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: NCCL between GPU 0 and GPU 1; cpu: Gloo")
    p.add_argument("--sizes", type=str, default=None,
                   help="request sizes in tokens, comma-separated (default: 16,64,256,1024,"
                        "4096,16384 on cuda; 16,64,256 on cpu)")
    p.add_argument("--trials", type=int, default=None, help="timed trials per size and mode")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--handover-tokens", type=int, default=None)
    p.add_argument("--handover-trials", type=int, default=None)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-message-mib", type=float, default=512.0)
    p.add_argument("--ahead-cycles", type=int, default=4_000_000,
                   help="GPU clock cycles of the stand-in prefill step in the 'ahead' mode "
                        "(long enough for the sender's host to enqueue the send)")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--check-failures", action="store_true",
                   help="also check timeout / peer-death recovery")
    p.add_argument("--failure-timeout", type=float, default=3.0)
    p.add_argument("--cpu-threads", type=int, default=2)
    p.add_argument("--git-commit", default=None,
                   help="commit to record when `git rev-parse HEAD` is not available")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "kv_transfer.json"))
    return p


def parse_args(argv=None) -> dict:
    a = _parser().parse_args(argv)
    cpu = a.device == "cpu"
    sizes = ([int(s) for s in a.sizes.split(",")] if a.sizes
             else ([16, 64, 256] if cpu else [16, 64, 256, 1024, 4096, 16384]))
    args = {
        "device": a.device, "sizes": sizes,
        "trials": a.trials if a.trials is not None else (5 if cpu else 20),
        "warmup": a.warmup,
        "handover_tokens": a.handover_tokens or (256 if cpu else 1024),
        "handover_trials": a.handover_trials or (20 if cpu else 100),
        "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim,
        "block_size": a.block_size, "dtype": a.dtype,
        "max_message_bytes": int(a.max_message_mib * 1024 * 1024),
        "ahead_cycles": a.ahead_cycles,
        "timeout": a.timeout, "check_failures": a.check_failures,
        "failure_timeout": a.failure_timeout, "cpu_threads": a.cpu_threads, "out": a.out,
        "git_commit": a.git_commit,
    }
    max_blocks = -(-max(sizes + [args["handover_tokens"]]) // a.block_size)
    args["verify_blocks"] = min(64, max_blocks)
    args["num_blocks"] = max(max_blocks, args["verify_blocks"]) + 64
    itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[a.dtype]
    args["bytes_per_token"] = a.layers * 2 * a.kv_heads * a.head_dim * itemsize
    # the chunked verification: about 4 messages
    args["verify_chunk_bytes"] = max(1, args["verify_blocks"] // 4) * a.block_size * \
        args["bytes_per_token"]
    return args


def _get(q, procs, what: str):
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            msg = q.get(timeout=1.0)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"a benchmark process died while waiting for {what}: "
                                 f"{[p.exitcode for p in procs]}") from None
            continue
        if msg[0] == "error":
            raise SystemExit(msg[1])
        return msg
    raise SystemExit(f"timed out waiting for {what}")


def _run_procs(args: dict, sched: dict) -> tuple[dict, float]:
    """Starts the receiver and the sender (and, with --check-failures, the restarted sender);
    returns their results by kind and the wall seconds."""
    ctx = mp.get_context("spawn")
    addr_q, go_q, t_q, res_q = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Queue()
    t_start = time.time()
    dec = ctx.Process(target=decode_proc, args=(args, sched, addr_q, go_q, t_q, res_q))
    pre = ctx.Process(target=prefill_proc, args=(args, sched, addr_q, go_q, t_q, res_q))
    dec.start()
    pre.start()
    procs = [dec, pre]
    results = {}
    try:
        kind, info = _get(res_q, procs, "the sender")
        results[kind] = info
        if args["check_failures"]:
            pre.join(60)
            restarted = ctx.Process(target=prefill_proc,
                                    args=(args, None, addr_q, go_q, t_q, res_q,
                                          None))
            restarted.start()
            procs.append(restarted)
        kind, info = _get(res_q, [dec], "the receiver")
        results[kind] = info
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    wall = time.time() - t_start
    return results, wall


def _summarise(args: dict, sched: dict, dec_res: dict) -> tuple[list[dict], dict]:
    """The per-size rows and the handover latencies (by mode) from the receiver's timings."""
    from pdserve.common.kv_transfer import plan_chunks
    bpt = args["bytes_per_token"]
    rows = []
    by_key: dict = {}
    for i, elapsed, send_s, nbytes in dec_res["timings"]:
        item = sched["items"][i]
        if item["warmup"]:
            continue
        key = (item["kind"], item["tokens"], item.get("mode", "scattered"))
        by_key.setdefault(key, []).append((elapsed, send_s, nbytes))
    for tokens in args["sizes"]:
        n_blocks = -(-tokens // args["block_size"])
        row = {"tokens": tokens, "bytes": n_blocks * args["block_size"] * bpt,
               "messages": len(plan_chunks(n_blocks, args["block_size"] * bpt,
                                           args["max_message_bytes"]))}
        for mode in MODES:
            xs = by_key[("bench", tokens, mode)]
            el = statistics.median(x[0] for x in xs)
            snd = statistics.median(x[1] for x in xs)
            nbytes = xs[0][2]
            row["bytes"] = nbytes
            row[mode] = {"median_ms": el * 1e3, "p90_ms": _pct([x[0] for x in xs], 90) * 1e3,
                         "GBps": nbytes / el / 1e9, "sender_median_ms": snd * 1e3,
                         "trials": len(xs)}
        rows.append(row)
    handovers = {}
    for mode in ("ahead", "scattered"):
        hv = [x[0] for x in by_key[("handover", args["handover_tokens"], mode)]]
        handovers[mode] = {"tokens": args["handover_tokens"], "trials": len(hv),
                           "p50_ms": _pct(hv, 50) * 1e3, "p99_ms": _pct(hv, 99) * 1e3,
                           "min_ms": min(hv) * 1e3, "max_ms": max(hv) * 1e3}
    return rows, handovers


def _print_summary(args: dict, device_name: str, nccl: str | None, dec_res: dict,
                   rows: list[dict], handovers: dict) -> None:
    bpt = args["bytes_per_token"]
    print(f"KV transfer: {device_name}, {args['device']} "
          f"({'NCCL ' + nccl if nccl else 'Gloo'}), {args['layers']} layers x "
          f"{args['kv_heads']} kv heads x {args['head_dim']} {args['dtype']}, block "
          f"{args['block_size']}: {bpt:,} B/token; max message "
          f"{args['max_message_bytes'] / 2**20:.0f} MiB")
    print("verification: " + ", ".join(
        f"{v['label']} ({v['blocks']} blocks) "
        f"{'bit-exact' if v['bit_exact'] and v['untouched_clean'] else 'MISMATCH'}"
        for v in dec_res["verify"]))
    hdr = (f"{'tokens':>7} {'MB':>9} {'msgs':>4} | {'scattered ms':>12} {'GB/s':>7} "
           f"{'send ms':>8} | {'contig ms':>9} {'GB/s':>7} {'send ms':>8} | "
           f"{'ahead ms':>8} {'GB/s':>7}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        s, c, a = r["scattered"], r["contiguous"], r["ahead"]
        print(f"{r['tokens']:>7} {r['bytes'] / 1e6:>9.2f} {r['messages']:>4} | "
              f"{s['median_ms']:>12.3f} {s['GBps']:>7.1f} {s['sender_median_ms']:>8.3f} | "
              f"{c['median_ms']:>9.3f} {c['GBps']:>7.1f} {c['sender_median_ms']:>8.3f} | "
              f"{a['median_ms']:>8.3f} {a['GBps']:>7.1f}")
    for mode, h in handovers.items():
        print(f"handover latency ({mode}), {h['tokens']} tokens, {h['trials']} trials: "
              f"p50 {h['p50_ms']:.3f} ms, p99 {h['p99_ms']:.3f} ms "
              f"(min {h['min_ms']:.3f}, max {h['max_ms']:.3f})")
    if dec_res["failures"] is not None:
        print("failure checks: " + json.dumps(dec_res["failures"], indent=1))


def _all_ok(dec_res: dict) -> bool:
    ok = all(v["bit_exact"] and v["untouched_clean"] for v in dec_res["verify"])
    if dec_res["failures"] is not None:
        f = dec_res["failures"]
        ok = ok and f["stalled"]["ok"] and f["peer_death"]["ok"] and \
            f["new_epoch_after_timeout"]["bit_exact"] and f["restarted_sender"]["bit_exact"]
    return ok


def _report(args: dict, device_name: str, nccl: str | None, torch_version: str,
            dec_res: dict, rows: list[dict], handovers: dict, ok: bool, wall: float) -> dict:
    handover = handovers["ahead"]
    return {
        "benchmark": "kv_transfer",
        "device": device_name,
        "backend": "nccl" if args["device"] == "cuda" else "gloo",
        "nccl_version": nccl,
        "torch": torch_version,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "git_commit": _git_commit(args["git_commit"]),
        "geometry": {k: args[k] for k in ("layers", "kv_heads", "head_dim", "block_size",
                                          "dtype", "bytes_per_token")},
        "max_message_bytes": args["max_message_bytes"],
        "ahead_cycles": args["ahead_cycles"],
        "method": "scattered / contiguous: time from before the gather on the sender (KV "
                  "ready, synchronised) to the scatter complete on the receiver (event "
                  "synchronised), perf_counter on one host; median over trials; scattered = "
                  "random non-contiguous block ids on both sides (gather + send + recv + "
                  "scatter), contiguous = block ranges sent from and received into the pool "
                  "directly. ahead = the send (blocks, the first token at the end) enqueued while a "
                  "stand-in prefill step still runs, ordered after its event, the receive "
                  "posted before; time from that event firing (polled by the sender's host) "
                  "to the scatter event complete (polled by the receiver's host), scattered "
                  "ids. handover = the ahead interval at handover_tokens (the served path); "
                  "handover_after_ready = the scattered interval",
        "verification": dec_res["verify"],
        "sizes": rows,
        "handover": handover,
        "handover_after_ready": handovers["scattered"],
        "failure_checks": dec_res["failures"],
        "all_ok": ok,
        "wall_seconds": wall,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    if args["device"] == "cuda":
        if torch.cuda.device_count() < 2:
            print("needs 2 GPUs (use --device cpu for the Gloo path)", file=sys.stderr)
            return 2
        device_name = torch.cuda.get_device_name(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        import platform
        device_name = f"cpu ({platform.processor() or platform.machine()}, Gloo)"
        nccl = None
    sched = make_schedule(args)
    results, wall = _run_procs(args, sched)
    dec_res = results["decode"]
    rows, handovers = _summarise(args, sched, dec_res)
    _print_summary(args, device_name, nccl, dec_res, rows, handovers)
    ok = _all_ok(dec_res)
    report = _report(args, device_name, nccl, torch.__version__, dec_res, rows, handovers, ok,
                     wall)
    out = Path(args["out"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
