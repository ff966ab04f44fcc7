"""Block pools for the KV transfer tests: a tiny geometry, seeded source pools, poisoned
destination pools, and the bit-exact landing check."""
from __future__ import annotations

from collections.abc import Sequence

import torch

# tiny geometry: [num_blocks, layers, 2, block_size, kv_heads, head_dim]
NUM_BLOCKS = 24
GEOM = (3, 2, 4, 2, 8)
POISON = 7.0


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def source_pool(seed: int, dtype: str, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, *GEOM, generator=g).to(dtype_of(dtype))


def poisoned_pool(dtype: str, num_blocks: int = NUM_BLOCKS) -> torch.Tensor:
    return torch.full((num_blocks, *GEOM), POISON, dtype=dtype_of(dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(bits(a.contiguous()), bits(b.contiguous())))


def check_landed(pool: torch.Tensor, src: torch.Tensor, src_ids: Sequence[int], dst_ids: Sequence[int],
                 touched: set[int]) -> list[str]:
    """Errors (empty when fine): dst blocks == src blocks bit for bit; blocks outside
    ``touched`` still poisoned."""
    errors = []
    for s, d in zip(src_ids, dst_ids):
        if not same_bits(pool[d], src[s]):
            errors.append(f"block {d} != source block {s}")
    poison = torch.full_like(pool[0], POISON)
    for b in range(pool.shape[0]):
        if b not in touched and not same_bits(pool[b], poison):
            errors.append(f"untouched block {b} changed")
    return errors
