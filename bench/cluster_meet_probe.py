"""Lab probe (issue 20): what it costs the split-K programs of one output tile to meet, on chip
(a thread-block cluster and distributed shared memory) against through global memory.

NOTES run 64 found the in-kernel meeting of a split-K tile through global memory (each split
stores its partial, counts itself with a release/acquire atomic, the last to arrive reads the
partials back) costs the last split 3-5 us, more than the separate kernel it replaces. The
device's Triton 3.6 Gluon has no cluster API, but its image has nvcc (CUDA 13.0), so this probe
builds CUDA C++ kernels with torch's cpp_extension. Each kernel: a grid of ``TILES x 1 x SPLITS``
programs of 128 threads; every program fills a 64 x 32 fp32 tile in shared memory (a stand-in
for its MMA result) and then

- ``plain``: stores its partial to global memory and ends (the product's split-K GEMM);
- ``plain+reduce``: as ``plain``, then a second kernel per tile sums the partials (the product's
  ``add_norm_partials`` without the norm);
- ``global``: stores its partial, one thread counts it (``atom.add.acq_rel.gpu``) after a CTA
  barrier, the last to arrive sums the partials (run 64's way);
- ``cluster``: the tile's SPLITS programs form one cluster; after ``cluster.sync()`` rank 0 reads
  the others' tiles through distributed shared memory, sums and stores (then a second
  ``cluster.sync()`` keeps the peers' shared memory alive until it has read it).

Each way is launched ``CHAIN`` times back to back in one CUDA graph (plain launches), timed per
launch (median of replays), and its result checked against the sum computed in torch. The
meeting's cost is each way's time minus ``plain``'s.

    python -m bench.cluster_meet_probe --out bench/results/cluster_meet/cluster_meet_probe_h100.json
"""
from __future__ import annotations

import argparse
import itertools
import os

import torch

from bench.common import graph_time, write_result

BM, BN, SPLITS, THREADS = 64, 32, 4, 128
CHAIN = 200

CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

constexpr int BM = 64, BN = 32, S = 4, THREADS = 128, TILE = BM * BN;

__device__ __forceinline__ void fill(float* tile, int salt) {
  for (int i = threadIdx.x; i < TILE; i += THREADS) tile[i] = (float)((i * 7 + salt) % 13);
}

constexpr int PER_THREAD = TILE / THREADS / 4;          // float4s a thread owns: 4

__device__ __forceinline__ void store_partial(const float* tile, float* __restrict__ part, int s, int t,
                                              int tiles) {
  float4* dst = reinterpret_cast<float4*>(part + ((size_t)s * tiles + t) * TILE);
  const float4* src = reinterpret_cast<const float4*>(tile);
  for (int j = 0; j < PER_THREAD; ++j) dst[threadIdx.x + j * THREADS] = src[threadIdx.x + j * THREADS];
}

// every load issued before any add or store: one round trip, not one per element
__device__ __forceinline__ void sum_partials(const float* __restrict__ part, float* __restrict__ out, int t,
                                             int tiles) {
  float4 v[S][PER_THREAD];
#pragma unroll
  for (int r = 0; r < S; ++r)
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j)
      v[r][j] = __ldcg(reinterpret_cast<const float4*>(part + ((size_t)r * tiles + t) * TILE)
                       + threadIdx.x + j * THREADS);
  float4* o = reinterpret_cast<float4*>(out + (size_t)t * TILE);
#pragma unroll
  for (int j = 0; j < PER_THREAD; ++j) {
    float4 a = v[0][j];
#pragma unroll
    for (int r = 1; r < S; ++r) { a.x += v[r][j].x; a.y += v[r][j].y; a.z += v[r][j].z; a.w += v[r][j].w; }
    o[threadIdx.x + j * THREADS] = a;
  }
}

__global__ void __launch_bounds__(THREADS) k_plain(float* part, int step) {
  __shared__ __align__(16) float tile[TILE];
  fill(tile, blockIdx.z + step);
  __syncthreads();
  store_partial(tile, part, blockIdx.z, blockIdx.x, gridDim.x);
}

__global__ void __launch_bounds__(THREADS) k_reduce(const float* part, float* out) {
  sum_partials(part, out, blockIdx.x, gridDim.x);
}

__global__ void __launch_bounds__(THREADS) k_global(float* part, float* out, int* cnt, int step) {
  __shared__ __align__(16) float tile[TILE];
  __shared__ int last;
  fill(tile, blockIdx.z + step);
  __syncthreads();
  store_partial(tile, part, blockIdx.z, blockIdx.x, gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    int prev;
    asm volatile("atom.add.acq_rel.gpu.s32 %0, [%1], 1;" : "=r"(prev) : "l"(cnt + blockIdx.x) : "memory");
    last = (prev == S - 1);
  }
  __syncthreads();
  if (last) {
    sum_partials(part, out, blockIdx.x, gridDim.x);
    if (threadIdx.x == 0) cnt[blockIdx.x] = 0;
  }
}

__global__ void __cluster_dims__(1, 1, S) __launch_bounds__(THREADS) k_cluster(float* out, int step) {
  __shared__ __align__(16) float tile[TILE];
  cg::cluster_group cluster = cg::this_cluster();
  unsigned rank = cluster.block_rank();
  fill(tile, (int)rank + step);
  cluster.sync();
  if (rank == 0) {
    float4 v[S][PER_THREAD];
#pragma unroll
    for (int r = 0; r < S; ++r) {
      const float4* peer = reinterpret_cast<const float4*>(cluster.map_shared_rank(tile, r));
#pragma unroll
      for (int j = 0; j < PER_THREAD; ++j) v[r][j] = peer[threadIdx.x + j * THREADS];
    }
    float4* o = reinterpret_cast<float4*>(out + (size_t)blockIdx.x * TILE);
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
      float4 a = v[0][j];
#pragma unroll
      for (int r = 1; r < S; ++r) { a.x += v[r][j].x; a.y += v[r][j].y; a.z += v[r][j].z; a.w += v[r][j].w; }
      o[threadIdx.x + j * THREADS] = a;
    }
  }
  cluster.sync();
}

static dim3 grid(int64_t tiles) { return dim3((unsigned)tiles, 1, S); }

void run_plain(torch::Tensor part, int64_t tiles, int64_t step) {
  k_plain<<<grid(tiles), THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(part.data_ptr<float>(), (int)step);
}
void run_plain_reduce(torch::Tensor part, torch::Tensor out, int64_t tiles, int64_t step) {
  auto stream = at::cuda::getCurrentCUDAStream();
  k_plain<<<grid(tiles), THREADS, 0, stream>>>(part.data_ptr<float>(), (int)step);
  k_reduce<<<dim3((unsigned)tiles), THREADS, 0, stream>>>(part.data_ptr<float>(), out.data_ptr<float>());
}
void run_global(torch::Tensor part, torch::Tensor out, torch::Tensor cnt, int64_t tiles, int64_t step) {
  k_global<<<grid(tiles), THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(
      part.data_ptr<float>(), out.data_ptr<float>(), cnt.data_ptr<int>(), (int)step);
}
void run_cluster(torch::Tensor out, int64_t tiles, int64_t step) {
  k_cluster<<<grid(tiles), THREADS, 0, at::cuda::getCurrentCUDAStream()>>>(out.data_ptr<float>(), (int)step);
}
"""

CPP_SRC = """
void run_plain(torch::Tensor part, int64_t tiles, int64_t step);
void run_plain_reduce(torch::Tensor part, torch::Tensor out, int64_t tiles, int64_t step);
void run_global(torch::Tensor part, torch::Tensor out, torch::Tensor cnt, int64_t tiles, int64_t step);
void run_cluster(torch::Tensor out, int64_t tiles, int64_t step);
"""


def build():
    from torch.utils.cpp_extension import load_inline
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    return load_inline("cluster_meet_probe", CPP_SRC, cuda_sources=CUDA_SRC,
                       functions=["run_plain", "run_plain_reduce", "run_global", "run_cluster"],
                       extra_cuda_cflags=["-O3"], verbose=False)


def expected(tiles: int, step: int) -> torch.Tensor:
    """The sum over the SPLITS partials that ``fill`` writes: [tiles * BM * BN]."""
    i = torch.arange(BM * BN, dtype=torch.int64)
    one = sum(((i * 7 + s + step) % 13).float() for s in range(SPLITS))
    return one.repeat(tiles).cuda()


def per_launch_us(launch) -> float:
    """Median us of one ``launch`` among CHAIN of them captured back to back in a CUDA graph (each
    with the next step number)."""
    steps = itertools.count()
    return graph_time(lambda: launch(next(steps)), calls=CHAIN, replays=20) * 1e6


def measure(ext, tiles: int) -> dict:
    part = torch.empty(SPLITS * tiles * BM * BN, device="cuda")
    out = torch.empty(tiles * BM * BN, device="cuda")
    cnt = torch.zeros(tiles, dtype=torch.int32, device="cuda")
    ways = {"plain": lambda s: ext.run_plain(part, tiles, s),
            "plain+reduce": lambda s: ext.run_plain_reduce(part, out, tiles, s),
            "global": lambda s: ext.run_global(part, out, cnt, tiles, s),
            "cluster": lambda s: ext.run_cluster(out, tiles, s)}
    row: dict = {"tiles": tiles, "programs": tiles * SPLITS}
    for name, launch in ways.items():
        us = per_launch_us(launch)
        if name != "plain":
            out.fill_(float("nan"))
            launch(CHAIN - 1)
            torch.cuda.synchronize()
            row[f"{name}_exact"] = bool(torch.equal(out, expected(tiles, CHAIN - 1)))
            assert not cnt.any(), cnt
        row[f"{name}_us"] = us
    for name in ("plain+reduce", "global", "cluster"):
        row[f"{name}_meet_us"] = row[f"{name}_us"] - row["plain_us"]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", default="32,64,128", help="output tiles (x SPLITS programs each)")
    p.add_argument("--out", default="bench/results/cluster_meet/cluster_meet_probe.json")
    args = p.parse_args(argv)
    ext = build()
    rows = [measure(ext, int(t)) for t in args.tiles.split(",")]
    for r in rows:
        print(f"tiles {r['tiles']:4d} ({r['programs']} programs): plain {r['plain_us']:.2f} us; meeting "
              f"+reduce kernel {r['plain+reduce_meet_us']:+.2f}, global {r['global_meet_us']:+.2f}, "
              f"cluster {r['cluster_meet_us']:+.2f} us; exact {r['plain+reduce_exact']} {r['global_exact']} "
              f"{r['cluster_exact']}")
    write_result(args.out, {"tile": [BM, BN], "splits": SPLITS, "threads": THREADS, "chain": CHAIN, "rows": rows})
    return 0 if all(r[k] for r in rows for k in r if k.endswith("_exact")) else 1


if __name__ == "__main__":
    raise SystemExit(main())
