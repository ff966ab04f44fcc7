"""The block hash chain shared by the router's prefix index and every BlockManager.

A full block's hash is xxh3-64 over the parent block's hash (8 bytes, little-endian; nothing
for the first block) followed by the block's token ids as little-endian int32. Two sequences
share a block's hash only if they share every token up to the end of that block.
"""
from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence as Seq

import xxhash

NO_PARENT = -1

_U64 = struct.Struct("<Q")


def _token_bytes(token_ids: Seq[int]) -> bytes:
    arr = array("i", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - all supported platforms have 4-byte int
        raise RuntimeError("array('i') is not 32-bit on this platform")
    return arr.tobytes()  # little-endian on every platform pdserve supports (x86-64, arm64)


def block_hash(token_ids: Seq[int], parent_hash: int = NO_PARENT) -> int:
    """Hash of one full block given its parent's hash (``NO_PARENT`` for the first block)."""
    h = xxhash.xxh3_64()
    if parent_hash != NO_PARENT:
        h.update(_U64.pack(parent_hash))
    h.update(_token_bytes(token_ids))
    return h.intdigest()


def block_hash_chain(token_ids: Seq[int], block_size: int) -> list[int]:
    """Hashes of every *full* block of ``token_ids``, in order (a partial tail is not hashed)."""
    hashes: list[int] = []
    parent = NO_PARENT
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(token_ids[start:start + block_size], parent)
        hashes.append(parent)
    return hashes
