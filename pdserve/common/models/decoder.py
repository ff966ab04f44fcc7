"""One decoder implementation for Llama, Qwen2 and Qwen3 checkpoints.

Differences are ModelConfig flags (``qk_norm``, ``attention_bias``, ``o_bias``, ``mlp_bias``,
tied embeddings); Q/K/V and gate/up are merged matmuls that ``load_weights`` fills from HF tensors.
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


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
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
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: str) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, rotary, backend)
        self.mlp = MLP(cfg)
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

    def __init__(self, cfg: ModelConfig, attention_backend: str = "torch") -> None:
        super().__init__()
        self.config = cfg
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, attention_backend)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden [T, H]."""
        if input_ids.is_cuda and use_fused(input_ids):
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

    def shard_sizes(self, merged: str) -> list[int]:
        c = self.config
        if merged == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        return [c.intermediate_size, c.intermediate_size]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters; returns the names of parameters loaded."""
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
            param = params[name]
            with torch.no_grad():
                if shard is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                    param.copy_(tensor)
                else:
                    sizes = self.shard_sizes(name.split(".")[-2])
                    start = sum(sizes[:shard])
                    param.narrow(0, start, sizes[shard]).copy_(tensor)
            loaded.add(f"{name}#{shard}" if shard is not None else name)
        return loaded
