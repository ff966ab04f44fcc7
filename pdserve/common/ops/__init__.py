"""Attention ops on the paged KV cache: Triton kernels (``kv_store``, ``paged_attention``,
imported only when a Triton backend is asked for), each with a pure-torch oracle (``reference``).

Conventions (docs/design.md, "KV cache layout" and "Attention ops"): caches are
``[num_blocks, block_size, Hkv, D]`` views of one layer; slot = ``block_id * block_size + offset``
(negative: padding, skipped); block tables ``[B, max_blocks]`` int32 padded with -1; GQA head
``h`` reads KV head ``h // (Hq // Hkv)``; a sequence with ``context_lens[b] == 0`` gets zeros.
"""
