"""The block hash chain shared by the router's prefix index and every BlockManager.

A full block's hash is xxh3-64 over the parent block's hash (8 bytes, little-endian; nothing
for the first block) followed by the block's token ids as little-endian int32. Two sequences
share a block's hash only if they share every token up to the end of that block.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence as Seq

import xxhash

NO_PARENT = -1

_U64 = struct.Struct("<Q")
_xxh3 = xxhash.xxh3_64_intdigest


def token_bytes(token_ids: Seq[int]) -> bytes:
    """The ids as little-endian int32 bytes: what a block hash covers (an id outside int32
    raises ``struct.error``)."""
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def block_hash(token_ids: Seq[int], parent_hash: int = NO_PARENT) -> int:
    """Hash of one full block given its parent's hash (``NO_PARENT`` for the first block)."""
    data = token_bytes(token_ids)
    return _xxh3(data if parent_hash == NO_PARENT else _U64.pack(parent_hash) + data)


def extend_chain(data: bytes, block_size: int, num_blocks: int, chain: list[int]) -> list[int]:
    """Extends ``chain`` (the hashes of the first ``len(chain)`` blocks of ``data``, the prompt's
    ``token_bytes``) to ``num_blocks`` blocks, in place; returns it."""
    step = block_size * 4
    parent = chain[-1] if chain else NO_PARENT
    for start in range(len(chain) * step, num_blocks * step, step):
        block = data[start:start + step]
        parent = _xxh3(block if parent == NO_PARENT else _U64.pack(parent) + block)
        chain.append(parent)
    return chain


def block_hash_chain(token_ids: Seq[int], block_size: int) -> list[int]:
    """Hashes of every *full* block of ``token_ids``, in order (a partial tail is not hashed)."""
    return extend_chain(token_bytes(token_ids), block_size, len(token_ids) // block_size, [])
