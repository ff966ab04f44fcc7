"""Runs the model for one engine step: batch preparation, the forward, sampling.

``prepare_prefill`` / ``prepare_decode`` turn scheduled Sequences into flat ``input_ids`` /
``positions`` and a ForwardContext; the KV pool is one tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` (docs/design.md). With
``tensor_parallel_size`` N > 1 this runner is rank 0 of N (engine/ranks.py): each rank holds its
KV heads, and every forward and LM-head call here is mirrored on the other ranks.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.common.config import EngineConfig, ModelConfig, parse_dtype, resolve_kv_cache_dtype
from pdserve.common.context import ForwardContext, forward_context
from pdserve.common.engine.launched_step import LaunchedStep as LaunchedStep  # re-exported: its old home
from pdserve.common.engine.prefill_batch import block_table_array, prefill_batch
from pdserve.common.engine.prompt_logprobs import PromptLogprobsPlan, PromptLogprobsStep
from pdserve.common.engine.ranks import RankLeader, rank_device
from pdserve.common.engine.sequence import Sequence
from pdserve.common.guided.bitmask import StepBitmask
from pdserve.common.layers.attention_backends import resolve_backend_name
from pdserve.common.layers.sampler import Sampler, SamplerOutput, SamplingBatch, prepare_sampling
from pdserve.common.loader import ModelSource, build_model
from pdserve.common.parallel import RankGroup, tp_rank

if TYPE_CHECKING:   # imported lazily where used (CUDA graphs only)
    from pdserve.common.engine.cuda_graph import DecodeGraphRunner
    from pdserve.common.engine.mixed_graph import MixedGraphRunner

logger = logging.getLogger(__name__)
CPU_DEFAULT_KV_GB = 1.0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} asked for but CUDA is not available")
    return device


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return parse_dtype(name)
    if device.type == "cpu":
        return torch.float32
    dtype = parse_dtype(model_cfg.torch_dtype)
    return torch.bfloat16 if dtype == torch.float32 else dtype


class ModelRunner:
    """``group``: given on ranks other than 0 (rank_main.py); rank 0 of a tensor-parallel engine
    starts the others itself (``leader``)."""

    def __init__(self, config: EngineConfig, source: ModelSource, group: RankGroup | None = None) -> None:
        self.config = config
        self.model_config = source.config
        self.device = rank_device(resolve_device(config.device), tp_rank(group))
        self.leader: RankLeader | None = None
        if group is None and config.tensor_parallel_size > 1:
            self.leader = RankLeader(config, source, self.device)
            group = self.leader.group
        self.group = group
        self.dtype = resolve_dtype(config.dtype, source.config, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.backend_name = resolve_backend_name(config.attention_backend, self.device.type)
        self.model = build_model(source, self.dtype, self.device, self.backend_name, config.seed, group,
                                 config.quantization)
        if self.leader is not None:
            self.leader.mirror(self.model)
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}
        self.kv_cache = torch.empty(0)
        self.num_kv_blocks = 0
        self.graph_runner: DecodeGraphRunner | None = None
        self.mixed_graph_runner: MixedGraphRunner | None = None
        self._sampling_key: tuple[int, ...] | None = None
        self._sampling_cache: SamplingBatch | None = None
        self.bitmask = StepBitmask(source.config.vocab_size, pin=self.device.type == "cuda")  # guided rows
        self.eos_token_ids: tuple[int, ...] = tuple(source.config.eos_token_ids)   # min_tokens bans them

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block (all layers, K and V) in the cache dtype: an FP8 cache's blocks
        are half a bf16 cache's, so the same memory holds twice the blocks."""
        c = self.model_config
        return (c.num_hidden_layers * 2 * self.block_size * self.model.num_local_kv_heads * c.head_dim
                * torch.tensor([], dtype=self.kv_cache_dtype).element_size())

    def _num_blocks_from_memory(self) -> int:
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 1024 ** 3
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free
            budget = total * self.config.gpu_memory_utilization - used_elsewhere - self._activation_reserve()
        else:
            budget = CPU_DEFAULT_KV_GB * 1024 ** 3
        return max(int(budget // self.block_bytes), 0)

    def _activation_reserve(self) -> int:
        """Bytes kept free for the largest prefill's activations and logits."""
        c = self.model_config
        tokens = self.config.max_num_batched_tokens
        elt = torch.tensor([], dtype=self.dtype).element_size()
        per_token = (c.hidden_size * 4 + c.intermediate_size * 3
                     + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * 2) * elt
        logits = self.config.max_num_seqs * c.vocab_size * 4 * 3
        return tokens * per_token + logits + (512 << 20)

    def allocate_kv_cache(self) -> int:
        """Allocate the KV pool (in ``kv_cache_dtype``) and bind each layer's views; returns the
        number of blocks. Each layer's FP8 scales stay as the model set them (1.0 by default)."""
        if self.leader is not None:
            self.leader.call("allocate_kv_cache")
        num_blocks = self.config.num_kv_blocks or self._num_blocks_from_memory()
        if self.group is not None:
            num_blocks = self.group.min_int(num_blocks)     # the blocks that fit on every rank
        if num_blocks < 1:
            raise RuntimeError("not enough memory for a single KV block; lower max_num_batched_tokens "
                               "or raise the KV memory")
        c = self.model_config
        self.kv_cache = torch.zeros(num_blocks, c.num_hidden_layers, 2, self.block_size,
                                    self.model.num_local_kv_heads, c.head_dim, dtype=self.kv_cache_dtype,
                                    device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[:, i, 0]
            attn.v_cache = self.kv_cache[:, i, 1]
        self.num_kv_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB, %s, %s)", num_blocks, self.block_size,
                    num_blocks * self.block_bytes / 1024 ** 3, self.kv_cache_dtype, self.device)
        return num_blocks

    def capture_cuda_graphs(self, max_model_len: int) -> None:
        """Capture decode graphs, and mixed-step graphs with chunked prefill (CUDA only, unless
        enforce_eager); every rank captures its own, their replays mirrored from rank 0."""
        if self.leader is None:
            return self._capture_cuda_graphs(max_model_len)
        self.leader.call("capture_cuda_graphs", max_model_len)
        with self.leader.paused():
            self._capture_cuda_graphs(max_model_len)
        if self.graph_runner is not None:
            self.graph_runner.before_run = self.leader.graph_hook("decode_graph")
        if self.mixed_graph_runner is not None:
            self.mixed_graph_runner.before_run = self.leader.graph_hook("mixed_graph")

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing at one rank)."""
        if self.leader is not None:
            self.leader.close()

    def _capture_cuda_graphs(self, max_model_len: int) -> None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        from pdserve.common.engine.cuda_graph import DecodeGraphRunner
        self.graph_runner = DecodeGraphRunner(
            self.model, min(self.config.max_num_seqs, 512), -(-max_model_len // self.block_size), max_model_len,
            self.device, use_workspace=self.backend_name == "triton")
        self.graph_runner.capture()
        if self.config.enable_chunked_prefill and self.backend_name == "triton":
            from pdserve.common.engine.mixed_graph import MixedGraphRunner
            self.mixed_graph_runner = MixedGraphRunner(
                self.model, min(self.config.max_num_seqs, 512),
                self.config.max_mixed_batched_tokens or self.config.max_num_batched_tokens,
                -(-max_model_len // self.block_size), max_model_len, self.device)
            self.mixed_graph_runner.capture()

    def _to_device(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _array_to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _block_tables(self, seqs: list[Sequence]) -> torch.Tensor:
        return self._array_to_device(block_table_array(seqs))

    def prepare_prefill(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        """A step computing tokens ``[num_cached_tokens, +num_scheduled_tokens)`` of each sequence;
        leading one-token rows (decode rows) go through decode attention."""
        nd = _num_decode_rows(seqs)
        batch = prefill_batch(seqs, self.block_size, nd)
        ctx = ForwardContext(
            is_prefill=True, slot_mapping=self._array_to_device(batch.slot_mapping),
            context_lens=self._array_to_device(batch.context_lens),
            block_tables=self._array_to_device(batch.block_tables),
            cu_seqlens_q=self._array_to_device(batch.cu_seqlens_q), max_seqlen_q=batch.max_seqlen_q,
            num_decode_tokens=nd, max_context_len=int(batch.context_lens[:nd].max()) if nd else None)
        if 0 < nd < len(seqs):
            # tensors of their own, not views: a view at an unaligned address is another Triton variant
            ctx.chunk_context_lens = self._array_to_device(batch.context_lens[nd:])
            ctx.chunk_block_tables = self._array_to_device(batch.block_tables[nd:])
        return self._array_to_device(batch.input_ids), self._array_to_device(batch.positions), ctx

    def prepare_decode(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, ForwardContext]:
        bs = self.block_size
        input_ids = [s.last_token for s in seqs]
        context_lens = [s.num_tokens for s in seqs]
        positions = [n - 1 for n in context_lens]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, positions)]
        ctx = ForwardContext(
            is_prefill=False, slot_mapping=self._to_device(slots, torch.int32),
            context_lens=self._to_device(context_lens, torch.int32),
            block_tables=self._block_tables(seqs), max_context_len=max(context_lens))
        return self._to_device(input_ids, torch.int64), self._to_device(positions, torch.int64), ctx

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> tuple[list[int], list[float] | None]:
        """Forward + sampling for one step; returns each sequence's next token (and logprob)."""
        return self.launch(seqs, is_prefill).result()

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], is_prefill: bool, src_rows: list[int] | None = None,
               prev_tokens: torch.Tensor | None = None, defer_guided: bool = False) -> LaunchedStep:
        """Enqueue forward + sampling for one step without waiting for the tokens; only sequences
        that reach their last token sample (``LaunchedStep.seqs``, step order). Decode row ``i``
        with ``src_rows[i] >= 0`` takes its input token from ``prev_tokens[src_rows[i]]`` on the
        device. ``defer_guided``: when a sampled row is guided, only the forward and the logits
        are enqueued; ``LaunchedStep.sample`` fills the token bitmask and samples later (once the
        guided rows' previous tokens are accepted)."""
        if is_prefill:
            input_ids, positions, ctx = self.prepare_prefill(seqs)
        else:
            input_ids, positions, ctx = self.prepare_decode(seqs)
        nd = ctx.num_decode_tokens if is_prefill else len(seqs)
        if src_rows is not None and prev_tokens is not None and nd:
            src = self._to_device(src_rows[:nd], torch.int64)
            input_ids[:nd] = torch.where(src >= 0, prev_tokens[src.clamp(min=0)], input_ids[:nd])
        sampled = [s for s in seqs if s.completes_in_step] if is_prefill else list(seqs)
        prompt = None
        if is_prefill:
            plan = PromptLogprobsPlan.of(seqs)
            if plan is None:
                hidden = self._forward_prefill(input_ids, positions, ctx, seqs)   # [len(sampled), H]
            else:
                hidden, prompt = self._forward_scored(input_ids, positions, ctx, seqs, plan)
        elif self.graph_runner is not None and self.graph_runner.can_run(len(seqs)):
            hidden = self.graph_runner.run(input_ids, positions, ctx)
        else:
            with forward_context(ctx):
                hidden = self.model(input_ids, positions)

        if not sampled:
            launched = LaunchedStep(self.device, sampled, prompt, kv_rows=is_prefill)
            launched.land(hidden.new_empty(0, dtype=torch.int64))
            return launched
        logits, batch = self.model.compute_logits(hidden), self._sampling_batch(sampled)
        launched = LaunchedStep(self.device, sampled, prompt, lambda: self._sample(logits, batch, sampled),
                                kv_rows=is_prefill)
        if not (defer_guided and any(s.guide is not None for s in sampled)):
            launched.sample()
        return launched

    def _forward_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                         seqs: list[Sequence]) -> torch.Tensor:
        """Hidden states of the rows to sample of a step with prompt tokens: replayed from a
        mixed-step graph when one fits, else eager."""
        rows = self._to_device(_last_rows(seqs), torch.int64)
        nd = ctx.num_decode_tokens
        mixed = self.mixed_graph_runner
        if mixed is not None and mixed.can_run(nd, input_ids.shape[0] - nd, len(seqs) - nd):
            return mixed.run(input_ids, positions, ctx, rows)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        return hidden[rows]

    def _forward_scored(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                        seqs: list[Sequence], plan: PromptLogprobsPlan
                        ) -> tuple[torch.Tensor, PromptLogprobsStep]:
        """A prefill step with prompt logprobs (always eager): the sampled rows' hidden states,
        and the plan's scoring enqueued from every row's hidden state."""
        rows = self._to_device(_last_rows(seqs), torch.int64)
        with forward_context(ctx):
            hidden = self.model(input_ids, positions)
        return hidden[rows], plan.launch(self.model.compute_logits, hidden)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        """The batch's sampling tensors, without a token bitmask; reused while the same sequences
        decode together (their parameters never change; batches with penalties depend on
        tokens: rebuilt)."""
        key = tuple(s.seq_id for s in seqs)
        if key == self._sampling_key and self._sampling_cache is not None:
            return self._sampling_cache
        batch = prepare_sampling(seqs, self.model_config.vocab_size, self.device, self.generators,
                                 self.eos_token_ids)
        self._sampling_key, self._sampling_cache = (key, batch) if not batch.per_step else (None, None)
        return batch

    @torch.inference_mode()
    def _sample(self, logits: torch.Tensor, batch: SamplingBatch, seqs: list[Sequence]) -> SamplerOutput:
        """Sample ``logits``; a batch with guided sequences first gets their token bitmask,
        filled on the host (after the forward is enqueued: it overlaps the forward on CUDA) from
        each guide caught up with its sequence's known tokens."""
        bitmask = self.bitmask.fill(seqs)
        if bitmask is not None:
            batch = dataclasses.replace(batch, token_bitmask=self.bitmask.upload(bitmask, self.device))
        return self.sampler(logits, batch)

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy KV block ``src`` to ``dst`` (all layers, K and V) for each ``(src, dst)``: the
        copy-on-write of a fork (engine/fork.py). Enqueued on the current stream, so it reads
        what the steps launched before it wrote; every rank copies its own heads."""
        if not pairs:
            return
        if self.leader is not None:
            self.leader.call("copy_blocks", [list(p) for p in pairs])
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=self.device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=self.device)
        self.kv_cache.index_copy_(0, dst, self.kv_cache.index_select(0, src))

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence state (its seeded generator) once it has finished."""
        self.generators.pop(seq.seq_id, None)


def _num_decode_rows(seqs: list[Sequence]) -> int:
    """Leading sequences that compute one token with all earlier KV cached (decode rows)."""
    n = 0
    while n < len(seqs) and seqs[n].num_scheduled_tokens == 1 and seqs[n].completes_in_step:
        n += 1
    return n


def _last_rows(seqs: list[Sequence]) -> list[int]:
    """Index of each sampling sequence's last computed token in the step's flat token rows."""
    rows, end = [], 0
    for seq in seqs:
        end += seq.num_scheduled_tokens
        if seq.completes_in_step:
            rows.append(end - 1)
    return rows
