"""One decoder implementation for Llama, Qwen2 and Qwen3 checkpoints.

Differences are ModelConfig flags (``qk_norm``, ``attention_bias``, ``o_bias``, ``mlp_bias``,
tied embeddings); Q/K/V and gate/up are merged matmuls that ``load_weights`` fills from HF tensors.
Built with a rank group of N ranks, each rank holds its shard (pdserve/common/parallel: qkv and
gate_up column-parallel, o_proj and down row-parallel, vocabulary-parallel embedding and LM head)
and loads its slice of every full tensor.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pdserve.common.config import ModelConfig
from pdserve.common.context import get_forward_context
from pdserve.common.layers.activation import SiluAndMul
from pdserve.common.layers.attention import PagedAttention
from pdserve.common.layers.fused_dispatch import use_fused
from pdserve.common.layers.norm import RMSNorm
from pdserve.common.layers.rotary import RotaryEmbedding
from pdserve.common.parallel import RankGroup, head_shard, split_evenly, tp_rank, tp_size
from pdserve.common.parallel.embedding import ParallelLMHead, VocabParallelEmbedding
from pdserve.common.parallel.linear import ColumnParallelLinear, RowParallelLinear


class SelfAttention(nn.Module):
    """This rank's heads (``num_heads`` / ``num_kv_heads``: the local counts)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str, group: RankGroup | None = None
                 ) -> None:
        super().__init__()
        heads = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, tp_size(group), tp_rank(group))
        d = cfg.head_dim
        self.num_heads = heads.num_q
        self.num_kv_heads = heads.num_kv
        self.head_dim = d
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_rows, kv_rows = (heads.q_start * d, heads.q_end * d), (heads.kv_start * d, heads.kv_end * d)
        full_kv = cfg.num_key_value_heads * d
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.num_attention_heads * d, full_kv, full_kv],
                                             [q_rows, kv_rows, kv_rows], cfg.attention_bias, group)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size, q_rows, cfg.o_bias, group)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, backend)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """positions: [T]; hidden: [T, H] -> [T, H]."""
        qkv = self.qkv_proj(hidden)
        if use_fused(qkv):
            q, k, v = self.fused_qk_norm_rope(qkv, positions)       # K/V already in the cache
            return self.o_proj(self.attn(q, k, v, kv_stored=True).reshape(-1, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)                               # [T, Hq, D]
        return self.o_proj(out.reshape(-1, self.q_size))


    def fused_qk_norm_rope(self, qkv: torch.Tensor, positions: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv: [T, (Hq + 2 Hkv) D], or its fp32 split-K partials [S, T, (Hq + 2 Hkv) D] (the
        small-batch chain) -> q, k, v through the fused qk-norm/RoPE kernel, K and V stored into
        the cache at the context's slots (when allocated)."""
        from pdserve.common.ops.fused import qk_norm_rope
        qw = self.q_norm.weight if self.qk_norm else None
        kw = self.k_norm.weight if self.qk_norm else None
        eps = self.q_norm.eps if self.qk_norm else 0.0
        allocated = self.attn.k_cache.numel() > 0              # else attn() raises
        kc, vc = (self.attn.k_cache, self.attn.v_cache) if allocated else (None, None)
        ctx = get_forward_context() if allocated else None
        slots = ctx.slot_mapping if ctx is not None else None
        return qk_norm_rope(qkv, positions, self.rotary.cos_cache, self.rotary.sin_cache, self.num_heads,
                            self.num_kv_heads, self.head_dim, qw, kw, eps, kc, vc, slots,
                            pdl=ctx is not None and ctx.pdl,
                            dtype=self.qkv_proj.weight.dtype if qkv.dim() == 3 else None,
                            k_scale=self.attn.k_scale, v_scale=self.attn.v_scale)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, group: RankGroup | None = None) -> None:
        super().__init__()
        cols = split_evenly(cfg.intermediate_size, tp_size(group), tp_rank(group))
        i = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [i, i], [cols, cols], cfg.mlp_bias, group)
        self.down_proj = RowParallelLinear(i, cfg.hidden_size, cols, cfg.mlp_bias, group)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str, group: RankGroup | None = None
                 ) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, rotary, backend, group)
        self.mlp = MLP(cfg, group)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderForCausalLM(nn.Module):
    """``forward`` returns final hidden states; ``compute_logits`` maps chosen rows to vocab."""

    # HF name fragment -> (our merged parameter, shard index)
    packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch", group: RankGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp_size = tp_size(group)
        heads = head_shard(cfg.num_attention_heads, cfg.num_key_value_heads, self.tp_size, tp_rank(group))
        self.q_heads = (heads.q_start, heads.q_end)         # the query heads this rank computes
        self.kv_heads = (heads.kv_start, heads.kv_end)      # the KV heads this rank holds (its KV cache)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens: nn.Embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, attention_backend, group)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.fp8_weights = False        # linears swapped for Fp8Linear (models/quantize.py): no decode chain

    @property
    def num_local_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_local_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden [T, H]."""
        if input_ids.is_cuda and self.tp_size == 1 and not self.fp8_weights and use_fused(input_ids):
            # the chain has no all-reduce and reads bf16 weights
            from pdserve.common.models import dataflow_decode  # imports Triton
            if dataflow_decode.applies(self, input_ids):
                return dataflow_decode.forward(self, input_ids, positions)
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def attention_layers(self) -> list[PagedAttention]:
        """Each decoder layer's paged attention, in layer order (the ModelRunner binds their KV views)."""
        attns = [layer.self_attn.attn for layer in self.layers if isinstance(layer, DecoderLayer)]
        if len(attns) != len(self.layers):
            raise TypeError("every entry of DecoderForCausalLM.layers must be a DecoderLayer")
        return attns

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, H] -> logits [B, V]."""
        return self.lm_head(hidden)

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        module_name, _, attr = name.rpartition(".")
        return self.get_submodule(module_name), attr

    def full_shape(self, name: str) -> tuple[int, ...]:
        """Parameter ``name``'s shape at one rank (its full tensor's)."""
        module, attr = self._owner(name)
        shape = getattr(module, "full_shape", None)
        return tuple(shape(attr)) if shape is not None else tuple(getattr(module, attr).shape)

    def load_param(self, name: str, tensor: torch.Tensor, part: int | None = None) -> None:
        """Copy this rank's slice of the full tensor into parameter ``name``; ``part``: the tensor is
        one part of a merged parameter (q/k/v, gate/up), None: the whole of it."""
        module, attr = self._owner(name)
        load = getattr(module, "load_shard", None)
        if load is not None:
            load(attr, tensor, part)
            return
        param = getattr(module, attr)
        if param.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)

    def expected_loads(self) -> set[str]:
        """What ``load_weights`` must have returned for a complete checkpoint."""
        out: set[str] = set()
        for name, _ in self.named_parameters():
            module, _ = self._owner(name)
            parts = len(module.parts) if isinstance(module, ColumnParallelLinear) else 1
            out.update(f"{name}#{i}" for i in range(parts)) if parts > 1 else out.add(name)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (this rank's slice of each); returns the names
        of parameters loaded (``name#part`` for a part of a merged one)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if name.startswith("lm_head.") and self.config.tie_word_embeddings:
                continue
            if "rotary_emb" in name:
                continue
            shard = None
            for fragment, (merged, index) in self.packed.items():
                if f".{fragment}." in name:
                    name, shard = name.replace(fragment, merged), index
                    break
            if name not in params:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no matching parameter ({name})")
            try:
                self.load_param(name, tensor, shard)
            except ValueError as e:
                raise ValueError(f"{hf_name}: {e}") from None
            loaded.add(f"{name}#{shard}" if shard is not None else name)
        return loaded
