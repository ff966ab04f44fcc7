"""Can decode attention read its KV faster than it does? TMA streaming reads (Gluon) against the
Triton read ceiling and the engine's decode attention kernel, in the engine's KV pool layout
(lab probe for issue 20, bench/NOTES.md run 60).

W-nano's decode steps spend ~4.9 s of 6.4 reading the KV at ~2.83 TB/s on average; a read at
3.07 TB/s (the best plain read of run 31) would take ~0.4 s off. This probe asks where the read
ceiling lies for attention's access pattern:

1. copy bandwidth (the bytes floor's) and a plain Triton grid-stride read (run 31's best configs);
2. a Gluon kernel streaming a 2 GiB buffer through a ring of TMA boxes, with and without reading
   each box back from shared memory (what attention must do), over box sizes, ring depths and
   programs per SM; every consuming variant's sum checked against a float64 sum;
3. attention's own pattern: per (sequence, KV head) program, the K and V boxes of each 64-token
   tile of the sequence's blocks (block table lookups as in the kernel), from the engine's pool
   ``[num_blocks, layers, 2, block_size, Hkv, D]`` (28 layers: the real strides), consumed and
   checked against torch's sum of the same elements;
4. ``paged_attention_decode`` on the same batches and pool layer (three configs, the default
   first), checked against the torch reference.

Block tables random (a permutation of the pool) or sequential (as a fresh block manager hands
them out). Bandwidth counts the bytes that must be read (for 3 and 4 the KV of the batch).
CUDA-graph timing of one layer replayed, and of the 28 layers one after the other (as in a
decode step: each layer's KV cold in L2).

  python -m bench.tma_read_probe --out bench/results/read_bw/tma_read_probe_h100.json
"""
from __future__ import annotations

import argparse
import random

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from bench.common import copy_bandwidth, graph_time, write_result
from bench.read_bw_probe import read_rows
from pdserve.common.ops.paged_attention import alloc_decode_workspace, decode_num_splits, paged_attention_decode
from pdserve.common.ops.reference import paged_attention_decode_ref

_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
_sync = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
HKV, HQ, D, BLOCK, LAYERS, LAYER = 8, 16, 128, 256, 28, 13
SUB = gl.constexpr(16)       # rows of a box read back from shared memory at once
STREAM_CONFIGS = [  # (box rows of 256 B, ring stages, programs per SM, consume)
    (64, 4, 1, False), (64, 8, 1, False), (128, 4, 1, False), (128, 6, 1, False), (256, 3, 1, False),
    (64, 4, 2, False), (128, 3, 2, False),
    (64, 4, 1, True), (64, 8, 1, True), (128, 4, 1, True), (128, 6, 1, True), (64, 4, 2, True),
    (128, 3, 2, True), (64, 6, 2, True)]
PATTERN_CONFIGS = [(64, 4), (32, 4), (32, 6)]   # (tokens a box, ring stages of K+V pairs)
ATTN_CONFIGS = [(64, 4, 3), (128, 4, 2), (32, 4, 4)]   # the engine kernel's (BLOCK_N, warps, stages); first = default


@gluon.jit
def _consume(buf, rows_valid, acc, BR: gl.constexpr, layout: gl.constexpr):
    """acc [SUB, W] += the first ``rows_valid`` rows of the shared box ``buf`` [BR, W]."""
    offs = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
    for r in gl.static_range(BR // SUB):
        x = buf.slice(r * SUB, SUB, dim=0).load(layout).to(gl.float32)
        keep = gl.expand_dims(offs + r * SUB < rows_valid, 1)
        acc += gl.where(keep, x, 0.0)
    return acc


@gluon.jit
def _stream_kernel(x_desc, part_ptr, n_tiles, STAGES: gl.constexpr, CONSUME: gl.constexpr,
                   num_warps: gl.constexpr):
    """Program p reads boxes p, p + P, ... of ``x`` [n_tiles * BR, W] through a ring of TMA loads."""
    BR: gl.constexpr = x_desc.block_type.shape[0]
    W: gl.constexpr = x_desc.block_type.shape[1]
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BR, W], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    mine = (n_tiles - pid + nprog - 1) // nprog
    for s in gl.static_range(STAGES):
        if s < mine:
            mbarrier.expect(bars.index(s), x_desc.block_type.nbytes)
            _tma_load(x_desc, [(pid + s * nprog) * BR, 0], bars.index(s), bufs.index(s))
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    acc = gl.zeros([SUB, W], gl.float32, layout)
    for i in range(mine):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        if CONSUME:
            acc = _consume(bufs.index(slot), BR, acc, BR, layout)
            _sync()
        nxt = i + STAGES
        if nxt < mine:
            mbarrier.expect(bars.index(slot), x_desc.block_type.nbytes)
            _tma_load(x_desc, [(pid + nxt * nprog) * BR, 0], bars.index(slot), bufs.index(slot))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    gl.store(part_ptr + pid, gl.sum(gl.sum(acc, axis=1), axis=0))


@gluon.jit
def _issue_pair(kv_desc, bufs, bars, slot, bt_row, t0, layer_rows, layer_off, kvh, BLOCK_SIZE: gl.constexpr):
    """TMA copies of the K and V boxes of the tile of tokens ``t0..t0+BN`` (head ``kvh``) into ring slot ``slot``."""
    W: gl.constexpr = kv_desc.block_type.shape[1]
    row = gl.load(bt_row + t0 // BLOCK_SIZE) * layer_rows + layer_off + t0 % BLOCK_SIZE
    mbarrier.expect(bars.index(slot), 2 * kv_desc.block_type.nbytes)
    _tma_load(kv_desc, [row, kvh * W], bars.index(slot), bufs.index(2 * slot))
    _tma_load(kv_desc, [row + BLOCK_SIZE, kvh * W], bars.index(slot), bufs.index(2 * slot + 1))


@gluon.jit
def _kv_pattern_kernel(kv_desc, bt_ptr, cl_ptr, part_ptr, stride_btb, LAYER_ROWS, LAYER_OFF,
                       BLOCK_SIZE: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Program (kvh, b): the K and V boxes [BN, D] of every BN-token tile of sequence b's context,
    head kvh, from the pool viewed as [rows, Hkv * D] (a row = one token of one block/layer/K|V)."""
    BN: gl.constexpr = kv_desc.block_type.shape[0]
    W: gl.constexpr = kv_desc.block_type.shape[1]
    kvh = gl.program_id(0)
    b = gl.program_id(1)
    ctx = gl.load(cl_ptr + b)
    n_t = gl.cdiv(ctx, BN)
    bufs = gl.allocate_shared_memory(kv_desc.dtype, [2 * STAGES, BN, W], kv_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    bt_row = bt_ptr + b.to(gl.int64) * stride_btb
    for s in gl.static_range(STAGES):
        if s < n_t:
            _issue_pair(kv_desc, bufs, bars, s, bt_row, s * BN, LAYER_ROWS, LAYER_OFF, kvh, BLOCK_SIZE)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    acc = gl.zeros([SUB, W], gl.float32, layout)
    for i in range(n_t):
        slot = i % STAGES
        mbarrier.wait(bars.index(slot), (i // STAGES) & 1)
        valid = ctx - i * BN
        acc = _consume(bufs.index(2 * slot), valid, acc, BN, layout)
        acc = _consume(bufs.index(2 * slot + 1), valid, acc, BN, layout)
        _sync()
        nxt = i + STAGES
        if nxt < n_t:
            _issue_pair(kv_desc, bufs, bars, slot, bt_row, nxt * BN, LAYER_ROWS, LAYER_OFF, kvh, BLOCK_SIZE)
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    gl.store(part_ptr + b * gl.num_programs(0) + kvh, gl.sum(gl.sum(acc, axis=1), axis=0))


def _desc(t: torch.Tensor, box: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), box, layout)


def stream_rows(n_bytes: int) -> list[dict]:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(n_bytes // (2 * D), D, dtype=torch.bfloat16, device="cuda")
    ref = x.double().sum().item()
    scale = x.double().abs().sum().item()
    rows = []
    for box, stages, per_sm, consume in STREAM_CONFIGS:
        n_tiles = x.shape[0] // box
        grid = per_sm * sms
        part = torch.full((grid,), float("nan"), dtype=torch.float32, device="cuda")
        desc = _desc(x, [box, D])

        def run(desc=desc, part=part, n_tiles=n_tiles, stages=stages, consume=consume, grid=grid):
            _stream_kernel[(grid,)](desc, part, n_tiles, STAGES=stages, CONSUME=consume, num_warps=4)
        row = {"box_rows": box, "box_bytes": box * D * 2, "stages": stages, "per_sm": per_sm, "consume": consume}
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is recorded, not fatal
            rows.append({**row, "skipped": f"{type(exc).__name__}: {str(exc)[:160]}"})
            continue
        if consume:
            err = abs(part.double().sum().item() - ref) / scale
            assert err < 1e-5, f"stream sum error {err} for {row}"
            row["rel_err"] = err
        secs = graph_time(run, replays=20)
        rows.append({**row, "GBps": n_tiles * box * D * 2 / secs / 1e9})
    return rows


def _pool(num_blocks: int) -> torch.Tensor:
    return torch.randn(num_blocks, LAYERS, 2, BLOCK, HKV, D, dtype=torch.bfloat16, device="cuda")


def _batch(lens: list[int], num_blocks: int, tables: str):
    """Block tables: ``random`` (a permutation of the pool) or ``sequential`` (each sequence's
    blocks one after the other, as the engine's block manager hands out a fresh pool)."""
    B = len(lens)
    max_blocks = -(-max(lens) // BLOCK)
    ids = torch.randperm(num_blocks, device="cuda") if tables == "random" else torch.arange(num_blocks, device="cuda")
    bt = ids[:B * max_blocks].view(B, max_blocks).to(torch.int32).contiguous()
    return bt, torch.tensor(lens, dtype=torch.int32, device="cuda")


def pattern_rows(kv: torch.Tensor, cases: dict[str, list[int]], tables: str) -> list[dict]:
    num_blocks = kv.shape[0]
    flat = kv.view(-1, HKV * D)                  # row = ((block * LAYERS + layer) * 2 + kv) * BLOCK + token
    layer_rows = LAYERS * 2 * BLOCK
    k_cache, v_cache = kv[:, LAYER, 0], kv[:, LAYER, 1]
    rows = []
    for name, lens in cases.items():
        bt, cl = _batch(lens, num_blocks, tables)
        B = len(lens)
        nbytes = sum(lens) * HKV * D * 2 * 2
        per_head = torch.zeros(B, HKV, dtype=torch.float64, device="cuda")
        for i, n in enumerate(lens):
            blocks = kv[bt[i, :-(-n // BLOCK)].long(), LAYER]          # [nb, 2, BLOCK, HKV, D]
            tok = blocks.permute(1, 0, 2, 3, 4).reshape(2, -1, HKV, D)[:, :n]
            per_head[i] = tok.double().sum(dim=(0, 1, 3))
        ref = per_head                                               # [B, HKV]: what each program sums
        for box, stages in PATTERN_CONFIGS:
            part = torch.full((B, HKV), float("nan"), dtype=torch.float32, device="cuda")
            desc = _desc(flat, [box, D])

            def run(desc=desc, part=part, bt=bt, cl=cl, stages=stages, B=B, layers=(LAYER,)):
                for layer in layers:
                    _kv_pattern_kernel[(HKV, B)](desc, bt, cl, part, bt.stride(0), layer_rows, layer * 2 * BLOCK,
                                                 BLOCK_SIZE=BLOCK, STAGES=stages, num_warps=4)
            row = {"kind": "tma_kv_pattern", "tables": tables, "case": name, "batch": B, "mean_ctx": sum(lens) / B,
                   "box_tokens": box, "stages": stages}
            try:
                run()
            except Exception as exc:  # noqa: BLE001
                rows.append({**row, "skipped": f"{type(exc).__name__}: {str(exc)[:160]}"})
                continue
            err = ((part.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, f"kv pattern sum error {err} for {row}"
            secs = graph_time(run, replays=30)
            every = graph_time(lambda run=run: run(layers=range(LAYERS)), replays=10) / LAYERS
            rows.append({**row, "rel_err": err, "us": secs * 1e6, "GBps": nbytes / secs / 1e9,
                         "us_all_layers": every * 1e6, "GBps_all_layers": nbytes / every / 1e9})
        splits = decode_num_splits(B, HKV, max(lens), "cuda")
        ws = alloc_decode_workspace(B, HQ, D, max(splits, 2), "cuda")
        for block_n, warps, stages in ATTN_CONFIGS:
            q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda")
            out = torch.full_like(q, float("nan"))
            cfg = dict(out=out, workspace=ws, num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
            paged_attention_decode(q, k_cache, v_cache, bt, cl, D ** -0.5, **cfg)
            want = paged_attention_decode_ref(q, k_cache, v_cache, bt, cl, D ** -0.5)
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, f"attention rel err {err} ({name})"
            def attend(q=q, bt=bt, cl=cl, cfg=cfg, layers=(LAYER,)):
                for layer in layers:
                    paged_attention_decode(q, kv[:, layer, 0], kv[:, layer, 1], bt, cl, D ** -0.5, **cfg)
            secs = graph_time(attend, replays=30)
            every = graph_time(lambda attend=attend: attend(layers=range(LAYERS)), replays=10) / LAYERS
            rows.append({"kind": "engine_attention", "tables": tables, "case": name, "batch": B,
                         "mean_ctx": sum(lens) / B, "splits": splits, "config": [block_n, warps, stages],
                         "rel_err": err, "us": secs * 1e6, "GBps": nbytes / secs / 1e9,
                         "us_all_layers": every * 1e6, "GBps_all_layers": nbytes / every / 1e9})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--read-gib", type=float, default=2.0)
    p.add_argument("--tables", default="random,sequential", help="block-table kinds, comma-separated")
    p.add_argument("--skip-stream", action="store_true", help="only the KV-pattern part (3 and 4)")
    p.add_argument("--out", default="bench/results/read_bw/tma_read_probe.json")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    rng = random.Random(0)
    copy_gbps = copy_bandwidth(1 << 31) / 1e9
    reads = [] if a.skip_stream else read_rows(int(a.read_gib * (1 << 30)))
    torch.cuda.empty_cache()
    streams = [] if a.skip_stream else stream_rows(int(a.read_gib * (1 << 30)))
    torch.cuda.empty_cache()
    cases = {"b256_ctx600": [600] * 256, "b64_ctx1200": [1200] * 64,
             "b256_ragged": [rng.randint(100, 1024) + rng.randint(0, 400) for _ in range(256)],
             "b128_ragged": [rng.randint(100, 1024) + rng.randint(100, 700) for _ in range(128)]}
    for lens in cases.values():
        lens.sort(reverse=True)                      # the engine orders rows longest first
    kv = _pool(256 * 6 + 16)
    pattern = [r for tables in a.tables.split(",") for r in pattern_rows(kv, cases, tables)]
    write_result(a.out, {"copy_GBps": copy_gbps, "read": reads, "stream": streams, "pattern": pattern})
    print(f"copy {copy_gbps:.0f} GB/s")
    for r in reads:
        print(f"  {r['way']:<44} {r['GBps']:7.0f}")
    for r in streams:
        tag = f"box {r['box_rows']:>3} x256B stages {r['stages']} {r['per_sm']}/SM consume {int(r['consume'])}"
        print(f"  tma stream {tag:<44} " + (f"{r['GBps']:7.0f}" if "GBps" in r else r["skipped"]))
    for r in pattern:
        tag = f"{r['kind']} {r['tables'][:3]} {r['case']} " + (
            f"box {r['box_tokens']} st {r['stages']}" if "box_tokens" in r else f"cfg {r['config']} sp {r['splits']}")
        print(f"  {tag:<60} " + (f"{r['us']:7.1f} us {r['GBps']:5.0f} GB/s, all layers {r['us_all_layers']:7.1f} us "
                                 f"{r['GBps_all_layers']:5.0f} GB/s" if "GBps" in r else r["skipped"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
