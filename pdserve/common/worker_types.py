"""What a worker tells the router, as the router's layers name it (no protobuf): the worker's
:class:`Role`, its identity (:class:`WorkerInfo`, from ``Info``), its load (:class:`WorkerStats`,
from ``GetStats``), a KV reservation (:class:`Reservation`, from ``Reserve``), and the one
promise of every worker's scheduling that the router models (``MIN_CHUNK_TOKENS``).

The wire forms (pdserve.v1) are converted by pdserve.common.grpc_utils.convert; a step's result
is :class:`pdserve.common.outputs.SequenceOutput` (the first token of a remote prefill too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Role(Enum):
    ROUTER = "router"        # the public router (service Generation)
    PREFILL = "prefill"      # computes prompts' KV and first tokens, ships KV to decode workers
    DECODE = "decode"        # receives KV, decodes in a continuous batch
    BOTH = "both"            # prefill and decode in one process, no KV transfer


DECODE_ROLES: frozenset[Role] = frozenset({Role.DECODE, Role.BOTH})        # run decode: take KV or Submit
PREFILL_CAPABLE: frozenset[Role] = frozenset({Role.PREFILL, Role.BOTH})    # may prefill for another worker

# The floor of every worker's TPOT guard (pdserve.common.engine.tpot_guard): a step with decode
# rows and prompts waiting computes at least this many prompt tokens. The router's placement
# models it (pdserve.router.fleet_policy), so it lives here, beside what a worker tells the router.
MIN_CHUNK_TOKENS = 32


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A server's identity and static configuration (``Info``); ``role`` None: not set."""

    protocol_version: str = ""
    role: Role | None = None
    model: str = ""
    dtype: str = ""
    block_size: int = 0
    max_model_len: int = 0
    num_kv_blocks: int = 0
    worker_id: str = ""
    version: str = ""
    vocab_size: int = 0
    kv_cache_dtype: str = ""          # the KV pool's element type ("bfloat16", "float8_e4m3fn"); "" = unknown
    tensor_parallel_size: int = 0     # ranks the model is split over; 0 = unknown (one)
    num_kv_heads: int = 0             # the model's KV heads (all ranks); 0 = unknown
    head_dim: int = 0                 # elements of one KV head of one token; 0 = unknown


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """A worker's load and counters (``GetStats``); the fields mean what worker.proto says."""

    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0
    num_waiting: int = 0
    num_running: int = 0
    num_reserved: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    num_preemptions: int = 0
    role: Role | None = None
    worker_id: str = ""
    num_kv_transfers: int = 0
    kv_transfer_bytes: int = 0
    num_waiting_prefill_tokens: int = 0
    num_running_context_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_step_ms: float = 0.0
    max_num_batched_tokens: int = 0
    chunked_prefill: bool = False
    mixed_step_ms: float = 0.0
    mixed_prompt_tokens: float = 0.0
    ms_per_prompt_token: float = 0.0
    tpot_target_ms: float = 0.0
    num_open_kv_channels: int = 0
    num_kv_channels_opened: int = 0
    tensor_parallel_size: int = 0


@dataclass(frozen=True, slots=True)
class Reservation:
    """KV blocks a decode worker reserved for a prompt (``Reserve``): the prefill worker's
    target. The first ``num_cached_tokens / block_size`` blocks already hold the prefix."""

    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    kv_store_address: str = ""
    worker_id: str = ""
    lease_expires_unix_ms: int = 0
    tensor_parallel_size: int = 0     # the decode worker's ranks (0 = one)
