"""The block hash chain (pdserve/common/hashing.py) against its definition: xxh3-64 over the
parent's hash (8 bytes little-endian, none for the first block) then the block's ids as int32."""
from __future__ import annotations

import random
import struct
from array import array

import xxhash

from pdserve.common.hashing import block_hash, block_hash_chain, extend_chain, token_bytes


def _definition(ids: list[int], block_size: int) -> list[int]:
    out: list[int] = []
    parent = None
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = xxhash.xxh3_64()
        if parent is not None:
            h.update(struct.pack("<Q", parent))
        h.update(array("i", ids[start:start + block_size]).tobytes())
        parent = h.intdigest()
        out.append(parent)
    return out


def test_chain_block_hash_and_extension_follow_the_definition() -> None:
    rng = random.Random(3)
    for _ in range(100):
        ids = [rng.randrange(200_000) for _ in range(rng.randrange(0, 200))]
        for bs in (1, 4, 16):
            want = _definition(ids, bs)
            assert block_hash_chain(ids, bs) == want
            if want:
                parent = want[-2] if len(want) > 1 else -1
                last = ids[(len(want) - 1) * bs:len(want) * bs]
                assert block_hash(last, parent) == want[-1]
            half = want[:len(want) // 2]
            assert extend_chain(token_bytes(ids), bs, len(want), list(half)) == want


def test_token_bytes_are_the_little_endian_int32_array() -> None:
    """``token_bytes`` packs with struct; the bytes are those of ``array("i", ids)`` (the
    definition) for any int32 ids, the extremes included."""
    rng = random.Random(11)
    for _ in range(300):
        high = rng.choice([50, 49_152, 2**20, 2**31])
        ids = [rng.randrange(high) for _ in range(rng.randrange(0, 3000))]
        ids += rng.sample([0, 1, 2**31 - 1, -1, -(2**31)], rng.randrange(0, 3))
        assert token_bytes(ids) == array("i", ids).tobytes() == struct.pack(f"<{len(ids)}i", *ids)
    assert token_bytes(tuple(range(5))) == array("i", range(5)).tobytes()
    assert token_bytes([]) == b""
