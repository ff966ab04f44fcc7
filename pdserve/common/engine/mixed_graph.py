"""CUDA graphs for mixed steps (chunked prefill): decode rows and prompt chunks in one replay,
since an eager mixed step is bound by host launch cost (chosen by measurement: bench/NOTES.md).

Graphs are keyed by ``(nd, tc)``: decode rows padded to a power of two (0 included) at
``[0, nd)``, chunk tokens padded to a ``CHUNK_BUCKETS`` size at ``[nd, nd + tc)``; padding rows
have slot -1 and context 0, padding chunk sequences no query. The graph ends with the hidden
states; LM head and sampler run outside. Steps that do not fit a graph run eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdserve.common.context import ForwardContext, forward_context
from pdserve.common.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)

CHUNK_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_CHUNK_SEQS = 8


def chunk_buckets(max_chunk_tokens: int) -> list[int]:
    cap = min(max_chunk_tokens, CHUNK_BUCKETS[-1])
    return [b for b in CHUNK_BUCKETS if b < cap] + [cap]


def decode_buckets(max_decode_bs: int) -> list[int]:
    """0 (chunks only) and powers of two up to ``max_decode_bs`` (padding decode rows is cheap
    next to a chunk; fewer sizes than the decode-only graphs keep the capture short)."""
    sizes, b = [0], 1
    while b < max_decode_bs:
        sizes.append(b)
        b *= 2
    return sizes + [max_decode_bs]


class MixedGraphRunner:
    def __init__(self, model: DecoderForCausalLM, max_decode_bs: int, max_chunk_tokens: int,
                 max_blocks_per_seq: int, max_context_len: int, device: torch.device,
                 max_chunk_seqs: int = MAX_CHUNK_SEQS) -> None:
        cfg = model.config
        self.model = model
        self.max_context_len = max_context_len
        self.decode_sizes = decode_buckets(max_decode_bs)
        self.chunk_sizes = chunk_buckets(max_chunk_tokens)
        self.max_chunk_seqs = max_chunk_seqs
        nd_max, tc_max = self.decode_sizes[-1], self.chunk_sizes[-1]
        i32 = torch.int32
        self.input_ids = torch.zeros(nd_max + tc_max, dtype=torch.int64, device=device)
        self.positions = torch.zeros(nd_max + tc_max, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((nd_max + tc_max,), -1, dtype=i32, device=device)
        self.decode_lens = torch.zeros(max(nd_max, 1), dtype=i32, device=device)
        self.decode_tables = torch.full((max(nd_max, 1), max_blocks_per_seq), -1, dtype=i32, device=device)
        self.chunk_lens = torch.zeros(max_chunk_seqs, dtype=i32, device=device)
        self.chunk_tables = torch.full((max_chunk_seqs, max_blocks_per_seq), -1, dtype=i32, device=device)
        self.cu_seqlens = torch.zeros(max_chunk_seqs + 1, dtype=i32, device=device)
        from pdserve.common.ops.paged_attention import DECODE_MAX_SPLITS, alloc_decode_workspace
        self.workspace = alloc_decode_workspace(max(nd_max, 1), model.num_local_heads, cfg.head_dim,
                                                DECODE_MAX_SPLITS, device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # called with each replay's inputs first (rank 0 of a tensor-parallel engine mirrors it)
        self.before_run: Callable[..., None] | None = None
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}

    def _context(self, nd: int, tc: int) -> ForwardContext:
        from pdserve.common.ops.paged_attention import decode_num_splits
        splits = decode_num_splits(nd, self.model.num_local_kv_heads, self.max_context_len,
                                   self.input_ids.device) if nd else None
        lens, tables = (self.decode_lens[:nd], self.decode_tables[:nd]) if nd else (self.chunk_lens, self.chunk_tables)
        return ForwardContext(
            is_prefill=True, slot_mapping=self.slot_mapping[:nd + tc], context_lens=lens, block_tables=tables,
            cu_seqlens_q=self.cu_seqlens, max_seqlen_q=tc, num_decode_tokens=nd,
            chunk_context_lens=self.chunk_lens, chunk_block_tables=self.chunk_tables,
            max_context_len=self.max_context_len, decode_workspace=self.workspace, decode_num_splits=splits)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        self.cu_seqlens.zero_()                  # no chunk sequence: the prefill kernel does nothing
        for nd in reversed(self.decode_sizes):
            for tc in reversed(self.chunk_sizes):
                graph = torch.cuda.CUDAGraph()
                with forward_context(self._context(nd, tc)):
                    self.model(self.input_ids[:nd + tc], self.positions[:nd + tc])   # compiles kernels
                    torch.cuda.synchronize()
                    with torch.cuda.graph(graph, pool):
                        self.outputs[nd, tc] = self.model(self.input_ids[:nd + tc], self.positions[:nd + tc])
                pool = graph.pool()
                self.graphs[nd, tc] = graph
        torch.cuda.synchronize()
        logger.info("captured %d mixed-step CUDA graphs (decode rows up to %d, chunk tokens up to %d)",
                    len(self.graphs), self.decode_sizes[-1], self.chunk_sizes[-1])

    def can_run(self, nd: int, tc: int, num_chunk_seqs: int) -> bool:
        return (bool(self.graphs) and nd <= self.decode_sizes[-1] and tc <= self.chunk_sizes[-1]
                and num_chunk_seqs <= self.max_chunk_seqs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
            rows: torch.Tensor) -> torch.Tensor:
        """Replay for a real mixed step (``ctx`` as ModelRunner.prepare_prefill builds it) and
        return the hidden states of ``rows`` (indices into the step's packed token rows)."""
        if self.before_run is not None:
            self.before_run(input_ids, positions, ctx, rows)
        nd = ctx.num_decode_tokens
        tc = input_ids.shape[0] - nd
        nd_pad = next(b for b in self.decode_sizes if b >= nd)
        tc_pad = next(b for b in self.chunk_sizes if b >= tc)
        self._fill(input_ids, positions, ctx, nd, nd_pad, tc, tc_pad)
        self.graphs[nd_pad, tc_pad].replay()
        if nd_pad != nd:
            rows = torch.where(rows >= nd, rows + (nd_pad - nd), rows)
        return self.outputs[nd_pad, tc_pad][rows]

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, nd: int, nd_pad: int,
              tc: int, tc_pad: int) -> None:
        """Copy the step's tensors into the static buffers of graph ``(nd_pad, tc_pad)``."""
        sources = ((self.input_ids, input_ids), (self.positions, positions), (self.slot_mapping, ctx.slot_mapping))
        for buf, src in sources:
            buf[:nd].copy_(src[:nd], non_blocking=True)
            buf[nd_pad:nd_pad + tc].copy_(src[nd:], non_blocking=True)
        self.slot_mapping[nd:nd_pad].fill_(-1)
        self.slot_mapping[nd_pad + tc:nd_pad + tc_pad].fill_(-1)
        if nd_pad:
            self.decode_lens[nd:nd_pad].zero_()
            self.decode_lens[:nd].copy_(ctx.context_lens[:nd], non_blocking=True)
            self.decode_tables[:nd, :ctx.block_tables.shape[1]].copy_(ctx.block_tables[:nd], non_blocking=True)
        ncs = 0                                  # tc == 0: every row decodes, no chunk
        if tc:
            lens, tables, cu_seqlens_q = _chunk_rows(ctx)
            ncs = lens.shape[0]
            if ncs:
                self.chunk_lens[:ncs].copy_(lens, non_blocking=True)
                self.chunk_tables[:ncs, :tables.shape[1]].copy_(tables, non_blocking=True)
                self.cu_seqlens[:ncs + 1].copy_(cu_seqlens_q, non_blocking=True)
        self.chunk_lens[ncs:].zero_()
        self.cu_seqlens[ncs + 1:].fill_(tc)     # padding sequences: no query (tc = 0 when ncs = 0)


def _chunk_rows(ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Context lens, block tables and ``cu_seqlens_q`` of a step's prompt-chunk rows (the
    ``chunk_*`` fields when decode rows lead, else the whole step's)."""
    nd = ctx.num_decode_tokens
    lens = ctx.chunk_context_lens if nd else ctx.context_lens
    tables = ctx.chunk_block_tables if nd else ctx.block_tables
    if lens is None or tables is None or ctx.cu_seqlens_q is None:
        raise RuntimeError("a mixed step with prompt chunks needs chunk_context_lens, chunk_block_tables "
                           "and cu_seqlens_q")
    return lens, tables, ctx.cu_seqlens_q
