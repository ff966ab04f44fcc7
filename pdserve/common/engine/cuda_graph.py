"""CUDA graphs for decode: one graph per captured batch size over static input buffers.

A decode step of ``bs`` sequences replays the graph of the smallest captured size ``>= bs``;
the padding rows get slot -1 (their KV store is skipped) and context length 0 (attention
writes zeros). Nothing inside a graph allocates or communicates; the split-KV workspace is
allocated once here. Batches above the largest captured size run eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdserve.common.context import ForwardContext, forward_context
from pdserve.common.models.decoder import DecoderForCausalLM

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sorted(set(sizes))


class DecodeGraphRunner:
    def __init__(self, model: DecoderForCausalLM, max_bs: int, max_blocks_per_seq: int, max_context_len: int,
                 device: torch.device, use_workspace: bool) -> None:
        cfg = model.config
        self.model = model
        self.max_context_len = max_context_len
        self.batch_sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        i32 = torch.int32
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_bs,), -1, dtype=i32, device=device)
        self.context_lens = torch.zeros(self.max_bs, dtype=i32, device=device)
        self.block_tables = torch.full((self.max_bs, max_blocks_per_seq), -1, dtype=i32, device=device)
        self.workspace: torch.Tensor | None = None
        self.use_workspace = use_workspace
        if use_workspace:
            from pdserve.common.ops.paged_attention import DECODE_MAX_SPLITS, alloc_decode_workspace
            self.workspace = alloc_decode_workspace(self.max_bs, model.num_local_heads, cfg.head_dim,
                                                    DECODE_MAX_SPLITS, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # called with each replay's inputs first (rank 0 of a tensor-parallel engine mirrors it)
        self.before_run: Callable[..., None] | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def _context(self, bs: int) -> ForwardContext:
        splits = None
        if self.use_workspace:
            from pdserve.common.ops.paged_attention import decode_num_splits
            splits = decode_num_splits(bs, self.model.num_local_kv_heads, self.max_context_len,
                                       self.input_ids.device)
        return ForwardContext(is_prefill=False, slot_mapping=self.slot_mapping[:bs],
                              context_lens=self.context_lens[:bs], block_tables=self.block_tables[:bs],
                              max_context_len=self.max_context_len,
                              decode_workspace=self.workspace, decode_num_splits=splits)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with forward_context(self._context(bs)):
                self.model(self.input_ids[:bs], self.positions[:bs])        # warm-up (compiles kernels)
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool):
                    self.outputs[bs] = self.model(self.input_ids[:bs], self.positions[:bs])
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for %d batch sizes (max %d)", len(self.graphs), self.max_bs)

    def can_run(self, bs: int) -> bool:
        return bs <= self.max_bs and bool(self.graphs)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Replay for a real batch of ``bs`` rows; returns hidden states ``[bs, H]``."""
        if self.before_run is not None:
            self.before_run(input_ids, positions, ctx)
        bs = input_ids.shape[0]
        gbs = next(b for b in self.batch_sizes if b >= bs)
        self.input_ids[:bs].copy_(input_ids, non_blocking=True)
        self.positions[:bs].copy_(positions, non_blocking=True)
        self.slot_mapping[bs:gbs].fill_(-1)
        self.slot_mapping[:bs].copy_(ctx.slot_mapping, non_blocking=True)
        self.context_lens[bs:gbs].zero_()
        self.context_lens[:bs].copy_(ctx.context_lens, non_blocking=True)
        width = ctx.block_tables.shape[1]
        self.block_tables[:bs, :width].copy_(ctx.block_tables, non_blocking=True)
        self.graphs[gbs].replay()
        return self.outputs[gbs][:bs]
