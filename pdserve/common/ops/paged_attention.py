"""Triton paged-attention kernels for decode (split-KV, GQA-packed); the varlen prefill kernel is
in paged_attention_prefill.py, with the checks and constants here.

Caches are ``[num_blocks, block_size, Hkv, D]`` views with a contiguous head dim; any block
size works. ``D`` a power of two (16..256), ``Hq % Hkv == 0``; fp32 softmax statistics and
accumulators, output in q's dtype. Decode grid ``(Hkv, num_splits, B)`` packs a KV head's query
heads into one ``tl.dot``; with ``num_splits > 1`` a second kernel combines the fp32 workspace.
Given ``out``, ``workspace`` and a fixed ``num_splits`` decode allocates nothing (CUDA-graph
safe). It never syncs with the host. An FP8 cache (``K / k_scale``, ``V / v_scale``, ops/fp8.py)
is read as is and widened to q's dtype; ``k_scale`` folds into the softmax scale and ``v_scale``
into the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.common.ops.fp8 import is_fp8
from pdserve.common.ops.pdl import launch_args, pdl_available

__all__ = [
    "paged_attention_decode",
    "alloc_decode_workspace",
    "decode_num_splits",
    "DECODE_MAX_SPLITS",
]

LOG2E = 1.4426950408889634
DECODE_MAX_SPLITS = 32          # upper bound of the split heuristic
_MIN_TOKENS_PER_SPLIT = 128     # do not split a context finer than this
_WS_PAD = 16                    # workspace row = D accumulators + m + l, padded to 16 floats
# With PDL, a decode grid of at most this many programs per SM releases the next kernel at its
# start (its programs preload while attention runs); a larger one at each program's end, so that
# they do not take the places of its later waves (bench/NOTES.md run 35: 3 per SM wins at batch
# <= 4, releasing at the start loses at batch 8-16 with 512 programs).
_EARLY_RELEASE_PER_SM = 3


# Per-batch integers are not specialised: no recompile when one becomes 1 or a multiple of 16.
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, cl_ptr, out_ptr, ws_ptr,
    qk_scale,                               # softmax scale * log2(e) * k_scale
    v_scale,
    num_splits,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_btb,
    stride_ob, stride_oh,
    stride_wb, stride_wh, stride_ws,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    RELEASE_EARLY: tl.constexpr = False,
):
    if PDL:                                 # wait for q and the cache; release the next kernel now
        if RELEASE_EARLY:                   # (one wave) or once this program is done (more waves)
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    kvh = tl.program_id(0)                  # fastest: a sequence's KV heads start together
    split = tl.program_id(1)
    b = tl.program_id(2)

    ctx = tl.load(cl_ptr + b)
    n_tiles = tl.cdiv(ctx, BLOCK_N)
    tiles_per_split = tl.cdiv(n_tiles, num_splits)
    t_begin = split * tiles_per_split * BLOCK_N
    t_end = tl.minimum(t_begin + tiles_per_split * BLOCK_N, ctx)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    heads = kvh * GROUP + offs_g

    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)

    bt_row = bt_ptr + b64 * stride_btb
    k_head = k_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_ptr + kvh.to(tl.int64) * stride_vh
    for t0 in range(t_begin, t_end, BLOCK_N):
        t = t0 + offs_n
        t_mask = t < t_end
        blk = tl.load(bt_row + t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        in_blk = (t % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_head + (blk * stride_kb + in_blk * stride_kt)[:, None] + offs_d[None, :],
                    mask=t_mask[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * qk_scale
        qk = tl.where(t_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + (blk * stride_vb + in_blk * stride_vt)[:, None] + offs_d[None, :],
                    mask=t_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc * v_scale
    if SINGLE_SPLIT:
        denom = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / denom[:, None]
        tl.store(out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        w_row = ws_ptr + b64 * stride_wb + heads * stride_wh + split * stride_ws
        tl.store(w_row[:, None] + offs_d[None, :], acc, mask=g_mask[:, None])
        tl.store(w_row + HEAD_DIM, m_i, mask=g_mask)
        tl.store(w_row + HEAD_DIM + 1, l_i, mask=g_mask)
    if PDL and not RELEASE_EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    ws_ptr, out_ptr, num_splits,
    stride_wb, stride_wh, stride_ws,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    row = ws_ptr + b * stride_wb + h * stride_wh + offs_s * stride_ws
    m = tl.load(row + HEAD_DIM, mask=s_mask, other=float("-inf"))
    l_s = tl.load(row + HEAD_DIM + 1, mask=s_mask, other=0.0)      # per-split softmax sums
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)   # all splits empty (context 0)
    w = tl.exp2(m - m_max)                                  # empty split: exp2(-inf) = 0
    l_sum = tl.sum(w * l_s, 0)
    acc = tl.load(row[:, None] + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    o = o / tl.where(l_sum > 0.0, l_sum, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty))


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (cached; 8 on the CPU, for the interpreter)."""
    if device.type != "cuda":
        return 8                                   # interpreter on the CPU: any small number
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def check_caches(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    Hq, D = q.shape[1], q.shape[2]
    assert k_cache.dim() == 4 and v_cache.shape == k_cache.shape, (k_cache.shape, v_cache.shape)
    _, block_size, Hkv, Dk = k_cache.shape
    assert Dk == D, (k_cache.shape, q.shape)
    assert Hq % Hkv == 0, f"Hq={Hq} not a multiple of Hkv={Hkv}"
    assert D >= 16 and D <= 256 and D & (D - 1) == 0, f"head_dim {D} must be a power of 2 in [16, 256]"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head dim must be contiguous"
    return Hq, Hkv, D, block_size


def kv_scales(k_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales a kernel multiplies by: the given ones for an FP8 cache, else 1."""
    return (float(k_scale), float(v_scale)) if is_fp8(k_cache) else (1.0, 1.0)


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def alloc_decode_workspace(max_batch: int, num_q_heads: int, head_dim: int, max_splits: int,
                           device: torch.device | str) -> torch.Tensor:
    """fp32 split workspace for ``paged_attention_decode``: ``[max_batch, Hq, max_splits, D+16]``.

    Row layout per (sequence, head, split): ``D`` unnormalized accumulators, then the running
    max (base 2) and the running sum; the rest is padding (keeps rows 64-byte aligned).
    """
    return torch.empty(max_batch, num_q_heads, max_splits, head_dim + _WS_PAD,
                       dtype=torch.float32, device=device)


def decode_num_splits(batch: int, num_kv_heads: int, max_context_len: int,
                      device: torch.device | str, max_splits: int = DECODE_MAX_SPLITS) -> int:
    """KV splits so that ``batch * num_kv_heads * splits`` is about four programs per SM, never
    below ``_MIN_TOKENS_PER_SPLIT`` tokens a split. Host-only (safe during graph capture);
    chosen by measurement: bench/NOTES.md.
    """
    device = torch.device(device)
    programs = max(1, batch * num_kv_heads)
    by_occupancy = (4 * sm_count(device) + programs // 2) // programs
    by_length = max(1, max_context_len // _MIN_TOKENS_PER_SPLIT)
    return int(max(1, min(by_occupancy, by_length, max_splits)))


def _decode_config(dtype: torch.dtype, head_dim: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) defaults for decode."""
    if device.type != "cuda":
        return 32, 4, 1
    if dtype == torch.float32:
        return 32, 4, 2
    return (64 if head_dim <= 128 else 32), 4, 3


def _decode_out(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out[:B]`` checked against ``q[B, Hq, D]``, or a new contiguous tensor like ``q``."""
    if out is None:
        return torch.empty_like(q, memory_format=torch.contiguous_format)
    assert out.shape[0] >= q.shape[0] and out.shape[1:] == q.shape[1:] and out.stride(-1) == 1, out.shape
    return out[:q.shape[0]]


def _split_workspace(workspace: torch.Tensor | None, q: torch.Tensor,
                     num_splits: int) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """The fp32 split workspace (given, checked, or allocated) and its (batch, head, split) strides."""
    B, Hq, D = q.shape
    if workspace is None:
        workspace = alloc_decode_workspace(B, Hq, D, num_splits, q.device)
    assert (workspace.dtype == torch.float32 and workspace.shape[0] >= B
            and workspace.shape[1] == Hq and workspace.shape[2] >= num_splits
            and workspace.shape[3] >= D + 2 and workspace.stride(-1) == 1), workspace.shape
    return workspace, (workspace.stride(0), workspace.stride(1), workspace.stride(2))


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, out: torch.Tensor | None = None,
                           workspace: torch.Tensor | None = None,
                           num_splits: int | None = None,
                           max_context_len: int | None = None,
                           block_n: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, pdl: bool = False, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention: ``q[B, Hq, D]``, one query per sequence at position ``context_lens-1``.

    ``out``: optional ``[>=B, Hq, D]`` (``out[:B]`` is returned); ``workspace``: from
    ``alloc_decode_workspace``; ``num_splits``: default ``decode_num_splits`` on
    ``max_context_len`` (default ``block_tables.shape[1] * block_size``). With all three given
    nothing is allocated or synchronized (CUDA-graph capture safe). ``pdl``: launch both kernels
    with programmatic dependent launch where ``pdl.pdl_available`` (each waits for the previous
    kernel before reading; the reduce kernel, and the split kernel when its grid has at most
    ``_EARLY_RELEASE_PER_SM`` programs an SM, release the next kernel at their start, a larger
    split grid at each program's end).
    """
    pdl = pdl and pdl_available(q.device)
    B = q.shape[0]
    Hq, Hkv, D, block_size = check_caches(q, k_cache, v_cache)
    out = _decode_out(q, out)
    if B == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert block_tables.shape[0] >= B and context_lens.shape[0] >= B
    assert block_tables.stride(-1) == 1

    group = Hq // Hkv
    if num_splits is None:
        max_ctx = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
        cap = workspace.shape[2] if workspace is not None else DECODE_MAX_SPLITS
        num_splits = decode_num_splits(B, Hkv, max_ctx, q.device, cap)
    num_splits = max(1, int(num_splits))
    cfg_n, cfg_w, cfg_s = _decode_config(q.dtype, D, q.device)
    block_n = block_n or cfg_n
    num_warps = num_warps or cfg_w
    num_stages = num_stages or cfg_s
    block_g = max(16, triton.next_power_of_2(group))
    single = num_splits == 1
    ws, ws_strides = (out, (0, 0, 0)) if single else _split_workspace(workspace, q, num_splits)
    k_scale, v_scale = kv_scales(k_cache, k_scale, v_scale)
    qk_scale = float(scale) * LOG2E * k_scale
    _decode_split_kernel[(Hkv, num_splits, B)](
        q, k_cache, v_cache, block_tables, context_lens, out, ws,
        qk_scale, v_scale, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *ws_strides,
        GROUP=group, BLOCK_G=block_g, HEAD_DIM=D, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        SINGLE_SPLIT=single, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **launch_args(pdl),
        **({"RELEASE_EARLY": Hkv * num_splits * B <= _EARLY_RELEASE_PER_SM * sm_count(q.device)} if pdl else {}),
    )
    if not single:
        _decode_reduce_kernel[(B, Hq)](
            ws, out, num_splits,
            *ws_strides,
            out.stride(0), out.stride(1),
            HEAD_DIM=D, BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
            num_warps=4 if D >= 128 else 2, **launch_args(pdl),
        )
    return out
