"""How a decoder is split over ``size`` ranks: contiguous, as-even-as-possible ranges.

- Attention: the KV heads are split over the ranks (the first ranks take one more when the count
  does not divide); each rank takes the query heads of its KV heads. With fewer KV heads than
  ranks, each KV head is replicated on ``size // num_kv_heads`` ranks, which split its query heads.
- MLP: the intermediate columns (gate/up rows, down columns) as even ranges.
- Vocabulary: ``ceil(vocab / size)`` rows a rank, the last one padded with zero rows (so the LM
  head's logits gather as equal shards).
"""
from __future__ import annotations

from dataclasses import dataclass


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` of ``n`` items cut into ``parts`` contiguous ranges
    whose sizes differ by at most one (the first ``n % parts`` are the larger)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """One rank's heads: query heads ``[q_start, q_end)`` and KV heads ``[kv_start, kv_end)``."""
    q_start: int
    q_end: int
    kv_start: int
    kv_end: int

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """Rank ``rank``'s heads (module docstring); ValueError when the heads cannot be split."""
    if size == 1:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_end = split_evenly(num_kv_heads, size, rank)
        return HeadShard(kv_start * group, kv_end * group, kv_start, kv_end)
    if size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size}: with fewer KV heads ({num_kv_heads}) than ranks, the ranks "
                         "must be a multiple of the KV heads (each KV head is replicated on the same number of ranks)")
    reps = size // num_kv_heads
    if group < reps:
        raise ValueError(f"tensor_parallel_size {size}: {num_heads} query heads over {num_kv_heads} KV heads leave "
                         f"fewer than one query head a rank")
    head = rank // reps
    q_start, q_end = split_evenly(group, reps, rank % reps)
    return HeadShard(head * group + q_start, head * group + q_end, head, head + 1)


def vocab_shard(vocab_size: int, size: int, rank: int) -> tuple[int, int, int]:
    """``(start, end, rows)``: rank ``rank`` holds vocabulary rows ``[start, end)`` in a shard of
    ``rows = ceil(vocab_size / size)`` rows (zero padded past ``end``)."""
    rows = -(-vocab_size // size)
    start = min(rank * rows, vocab_size)
    return start, min(start + rows, vocab_size), rows


def check_tensor_parallel(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int) -> None:
    """ValueError naming the problem when a model cannot be split over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size > num_heads:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's {num_heads} query heads")
    if size > intermediate_size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's intermediate size {intermediate_size}")
    for rank in range(size):
        head_shard(num_heads, num_kv_heads, size, rank)
