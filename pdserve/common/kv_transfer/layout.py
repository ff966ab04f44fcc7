"""How a worker's KV pool is split over its tensor-parallel ranks, and the routes of a transfer
between two such layouts.

A worker of ``tensor_parallel_size`` N holds on rank ``r`` the KV heads of
``pdserve.common.parallel.sharding.head_shard`` (contiguous ranges; replicated when there are
fewer KV heads than ranks), every rank the same block ids. A transfer from a prefill layout to a
decode layout is a list of :class:`Route`: prefill rank ``src`` ships heads ``src_heads`` (its
local indices) of the blocks to decode rank ``dst``, into its local heads ``dst_heads``. Every
head of every decode rank comes from exactly one prefill rank (the first that holds it), so the
routes cover each decode rank's pool once; route ``(0, 0)`` always exists (both rank 0s hold
head 0) and carries the first token.

Channels are named per rank: rank ``r`` of a worker of N > 1 ranks is ``"{worker_id}.r{r}"``, a
worker of one rank keeps its id, so a pair of one-rank workers is unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.parallel.sharding import split_evenly


@dataclass(frozen=True)
class KvLayout:
    """One worker's KV layout as its peers see it (ServerInfo / Reserve / PushKV fields)."""
    tensor_parallel_size: int
    num_kv_heads: int
    head_dim: int
    cache_dtype: str = ""

    def __str__(self) -> str:
        dtype = f", {self.cache_dtype}" if self.cache_dtype else ""
        return f"TP{self.tensor_parallel_size} ({self.num_kv_heads} KV heads of dim {self.head_dim}{dtype})"

    def kv_heads(self, rank: int) -> tuple[int, int]:
        """The global KV heads ``[start, end)`` rank ``rank`` holds (as ``head_shard`` splits them)."""
        size, heads = self.tensor_parallel_size, self.num_kv_heads
        if heads >= size:
            return split_evenly(heads, size, rank)
        if size % heads:
            raise ValueError(f"{self}: the ranks must be a multiple of the KV heads")
        head = rank // (size // heads)
        return head, head + 1


@dataclass(frozen=True)
class Route:
    """Prefill rank ``src`` ships its local heads ``src_heads`` to decode rank ``dst``'s local
    heads ``dst_heads`` (``[start, end)``, the same count)."""
    src: int
    dst: int
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.src_heads[1] - self.src_heads[0]


def rank_name(worker_id: str, rank: int, tensor_parallel_size: int) -> str:
    """The id a worker's rank uses on pair channels (module docstring)."""
    return worker_id if tensor_parallel_size == 1 else f"{worker_id}.r{rank}"


def pair_error(prefill: KvLayout, decode: KvLayout) -> str | None:
    """Why KV of ``prefill``'s layout cannot be read by ``decode``'s (None: it can). Any split
    over ranks pairs with any other; the heads, their size and the cache dtype must agree (a field
    of 0 or "" is unknown and not compared)."""
    def differ(a, b) -> bool:
        return bool(a) and bool(b) and a != b
    if (differ(prefill.num_kv_heads, decode.num_kv_heads) or differ(prefill.head_dim, decode.head_dim)
            or differ(prefill.cache_dtype, decode.cache_dtype)):
        return (f"KV layouts cannot be paired: the prefill worker's KV is {prefill}, this decode worker's "
                f"is {decode}; every worker of a deployment must serve the same model with the same "
                "--kv-cache-dtype (and --dtype)")
    return None


def routes(prefill: KvLayout, decode: KvLayout) -> list[Route]:
    """The routes of a transfer from ``prefill``'s ranks to ``decode``'s (module docstring),
    ordered by (dst, src). ValueError when the layouts cannot be paired (or a head count is
    unknown)."""
    why = pair_error(prefill, decode)
    if why is not None or not prefill.num_kv_heads or not decode.num_kv_heads:
        raise ValueError(why or f"KV heads unknown: {prefill} -> {decode}")
    out: list[Route] = []
    src_ranges = [prefill.kv_heads(r) for r in range(prefill.tensor_parallel_size)]
    for dst in range(decode.tensor_parallel_size):
        d0, d1 = decode.kv_heads(dst)
        head = d0
        while head < d1:
            src = next(r for r, (s0, s1) in enumerate(src_ranges) if s0 <= head < s1)
            s0, s1 = src_ranges[src]
            end = min(s1, d1)
            out.append(Route(src, dst, (head - s0, end - s0), (head - d0, end - d0)))
            head = end
    return out


def model_block_bytes(rank_block_bytes: int, local_kv_heads: int, num_kv_heads: int) -> int:
    """Bytes of one block over every KV head of the model, from one rank's block of
    ``local_kv_heads`` heads (what PushKV.num_bytes counts per block)."""
    return rank_block_bytes // local_kv_heads * num_kv_heads
