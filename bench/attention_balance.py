"""Decode attention with ragged contexts: how much the order of the sequences (and the KV
split count) costs when the contexts of one batch differ, as in W-nano.

For each batch size: contexts drawn as in W-nano's decode phase (prompt ``U(100, 1024)`` plus
tokens generated so far), then the same kernel on (a) uniform contexts of the same mean, (b) the
ragged contexts in random order, (c) sorted longest first, (d) sorted shortest first, each with
the split count the engine would pick and with ``--splits`` alternatives. Bandwidth is over the
KV bytes the batch must read. Checks every output against the torch reference first.

  python -m bench.attention_balance --out /tmp/attention_balance.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

from bench.common import graph_time
from pdserve.common.ops.paged_attention import alloc_decode_workspace, decode_num_splits, paged_attention_decode
from pdserve.common.ops.reference import paged_attention_decode_ref

HKV, HQ, D, BLOCK = 8, 16, 128, 256


def _case(lens: list[int], k_cache, v_cache, splits: int, check: bool) -> dict:
    dev = k_cache.device
    B = len(lens)
    max_blocks = -(-max(lens) // BLOCK)
    perm = torch.randperm(k_cache.shape[0], device=dev)
    bt = perm[:B * max_blocks].view(B, max_blocks).to(torch.int32).contiguous()
    cl = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(B, HQ, D, dtype=k_cache.dtype, device=dev)
    scale = D ** -0.5
    if check:
        out = paged_attention_decode(q, k_cache, v_cache, bt, cl, scale, num_splits=splits)
        ref = paged_attention_decode_ref(q, k_cache, v_cache, bt, cl, scale)
        err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        assert err < 2e-2, f"rel err {err}"
    out = torch.empty_like(q)
    ws = alloc_decode_workspace(B, HQ, D, max(splits, 2), dev)
    secs = graph_time(lambda: paged_attention_decode(q, k_cache, v_cache, bt, cl, scale, out=out,
                                                     workspace=ws, num_splits=splits), replays=30)
    nbytes = sum(lens) * HKV * D * 2 * k_cache.element_size()
    return {"ms": secs * 1e3, "GBps": nbytes / secs / 1e9}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="256:300,192:500,128:650,64:800,32:900")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--out", default="bench/results/attention_balance.json")
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    rng = random.Random(0)
    num_blocks = 4096
    k_cache = torch.randn(num_blocks, BLOCK, HKV, D, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    rows = []
    for spec in a.batches.split(","):
        B, step = (int(x) for x in spec.split(":"))
        lens = [rng.randint(100, 1024) + step for _ in range(B)]
        while sum(-(-n // BLOCK) for n in lens) > num_blocks:
            lens = lens[:-1]
        mean = sum(lens) // len(lens)
        orders = {"uniform": [mean] * len(lens), "random": lens,
                  "longest_first": sorted(lens, reverse=True), "shortest_first": sorted(lens)}
        auto = decode_num_splits(len(lens), HKV, 4096, dev)
        for splits in sorted({auto, *(int(s) for s in a.splits.split(","))}):
            for name, ls in orders.items():
                r = _case(ls, k_cache, v_cache, splits, check=(name == "random"))
                rows.append({"batch": len(lens), "mean_context": mean, "order": name,
                             "splits": splits, "auto_splits": auto, **r})
                print(f"B={len(lens):4d} mean={mean:5d} splits={splits} (auto {auto}) "
                      f"{name:>15}: {r['ms']:.3f} ms {r['GBps']:7.1f} GB/s", flush=True)
    with open(a.out, "w") as f:
        json.dump({"benchmark": "attention_balance", "device": torch.cuda.get_device_name(),
                   "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "command": "python -m bench.attention_balance " + " ".join(sys.argv[1:] if argv is None else argv),
                   "git_commit": os.environ.get("PDSERVE_GIT_COMMIT"), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
