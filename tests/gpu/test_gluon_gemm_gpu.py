"""The Gluon GEMMs of the decode chain's wide range (pdserve/common/ops/gluon_gemm.py) against torch
on fresh random inputs: every tile class, the Qwen3-0.6B and Qwen3-8B projection shapes, plain and
PDL launches, and replayed from a CUDA graph."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.common.models.dataflow_decode import wide_available
from pdserve.common.ops.gemm_tiles import wide_tiles

pytestmark = pytest.mark.gpu
# (hidden, q, qkv, intermediate) of Qwen3-0.6B and Qwen3-8B
GEOMETRIES = {"0.6b": (1024, 2048, 4096, 3072), "8b": (4096, 4096, 6144, 12288)}
ROWS = [33, 48, 64, 65, 100, 128, 129, 200, 256]


def _needs_gluon() -> None:
    if not torch.cuda.is_available() or not wide_available(torch.device("cuda")):
        pytest.skip("the Gluon kernels need a Hopper GPU")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _inputs(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
    return a, w


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
@pytest.mark.parametrize("m", ROWS)
def test_linear_splitk_and_silu_linear_match_torch(geometry, m):
    _needs_gluon()
    from pdserve.common.ops import gluon_gemm
    hidden, q, qkv, inter = GEOMETRIES[geometry]
    pdl = m % 2 == 0                                    # both launch kinds across the rows
    a, w = _inputs(m, qkv, hidden, m)
    out = gluon_gemm.linear(a, w, wide_tiles("qkv", m), pdl=pdl)
    assert out.shape == (m, qkv) and out.dtype == torch.bfloat16
    assert _rel(out, F.linear(a, w)) < 1e-2 and _rel(out, a.float() @ w.float().t()) < 1e-2
    for op, (n, k) in (("o_proj", (hidden, q)), ("down", (hidden, inter))):
        a, w = _inputs(m, n, k, m + 1)
        tiles = wide_tiles(op, m)
        part = gluon_gemm.splitk(a, w, tiles, pdl=pdl)
        rows = -(-m // tiles.bm) * tiles.bm
        assert part.shape == (tiles.splits, rows, n) and part.dtype == torch.float32
        assert _rel(part[:, :m].sum(0), a.float() @ w.float().t()) < 1e-3
    a, w = _inputs(m, 2 * inter, hidden, m + 2)
    act = gluon_gemm.silu_linear(a, w, wide_tiles("gate_up", m), pdl=pdl)
    gu = F.linear(a, w)                                 # rounded to bf16, as the unfused path
    ref = F.silu(gu[:, :inter].float()) * gu[:, inter:].float()
    assert act.shape == (m, inter) and _rel(act, ref) < 1e-2 and not act.isnan().any()


def test_replayed_from_a_cuda_graph_bit_for_bit():
    """The three kinds back to back with PDL, captured once and replayed over fresh inputs
    copied into the captured buffers: the same bits as eager launches."""
    _needs_gluon()
    from pdserve.common.ops import gluon_gemm
    m, hidden, q, qkv, inter = 80, *GEOMETRIES["0.6b"]
    a, w_qkv = _inputs(m, qkv, hidden, 1)
    _, w_o = _inputs(m, hidden, q, 2)
    _, w_gu = _inputs(m, 2 * inter, hidden, 3)

    def chain(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = gluon_gemm.linear(x, w_qkv, wide_tiles("qkv", m))
        part = gluon_gemm.splitk(y[:, :q].contiguous(), w_o, wide_tiles("o_proj", m))
        act = gluon_gemm.silu_linear(x, w_gu, wide_tiles("gate_up", m))
        return y, part, act
    static = a.clone()
    chain(static)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(static)
    for seed in (4, 5):
        fresh, _ = _inputs(m, 8, hidden, seed)
        static.copy_(fresh)
        for t in outs:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(outs, chain(fresh)):
            assert torch.equal(got, want)
