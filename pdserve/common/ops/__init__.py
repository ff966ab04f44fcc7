"""Attention ops on the paged KV cache: Triton kernels, each with a pure-torch reference.

Modules (nothing here imports Triton at package import time; import the kernel modules only
when a Triton backend is asked for):

- ``pdserve.common.ops.reference``: ``store_kvcache_ref``, ``paged_attention_decode_ref``,
  ``paged_attention_prefill_ref``. Pure torch, CPU or GPU, any dtype (computed in float32).
  They are the oracle in tests and the CPU production path of the "torch" attention backend.
- ``pdserve.common.ops.kv_store``: ``store_kvcache`` (Triton), writes new tokens' K/V into the cache.
- ``pdserve.common.ops.paged_attention``: ``paged_attention_decode`` (split-KV, GQA-packed, CUDA-graph
  friendly: preallocated output/workspace and a fixed ``num_splits`` can be passed) and
  ``paged_attention_prefill`` (varlen, causal with a cached prefix, flash-attention style).

Shared conventions (docs/design.md, "KV cache layout" and "Attention ops"):

- ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_dim]`` views with
  an arbitrary block stride (one layer of the per-worker ``kv_cache[num_blocks, num_layers, 2,
  block_size, num_kv_heads, head_dim]``); the inner three dims are contiguous.
- A slot is ``block_id * block_size + offset_in_block``; a negative slot is padding, skipped.
- Block tables are ``[B, max_blocks]`` int32, padded with -1 past a sequence's last block.
- Query ``i`` of sequence ``b`` in prefill sits at position ``context_lens[b] - q_len_b + i``
  and sees keys ``0..position``; decode's single query sits at ``context_lens[b] - 1``.
- GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``.
- A sequence with ``context_lens[b] == 0`` (padding rows of a CUDA-graph batch) gets zeros.
"""
