"""Checks of the internal API's requests, made as if each came from a stranger: every field that
reaches the engine, the KV pool or a pair channel is bounded against this worker's
:class:`Limits`, and a bad one raises InvalidArgument naming it (INVALID_ARGUMENT through the
interceptor) before anything is allocated. Pure functions of the message and the limits; the
checks that need state (a reservation, an epoch) stay with that state.

The prefill side's checks live here and the decode worker's (pdserve.decode_worker.validation)
build on them: a worker of role both serves both.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.common.config import dtype_name
from pdserve.common.grpc_utils.errors import InvalidArgument
from pdserve.common.kv_transfer import KvTransferError
from pdserve.common.kv_transfer.store import split_address

if TYPE_CHECKING:
    from pdserve.common.engine.llm_engine import LLMEngine

#: Longest worker id accepted from a peer (it names store prefixes, threads and log lines).
MAX_WORKER_ID_CHARS = 256


@dataclass(frozen=True)
class Limits:
    """What this worker's engine can take, fixed once the model is loaded."""
    vocab_size: int
    max_model_len: int     # prompt + generated tokens; within the KV pool
    num_blocks: int        # KV blocks in the pool
    block_bytes: int       # bytes of one KV block (all layers)
    kv_cache_dtype: str = ""   # the pool's element type (config.dtype_name); "" = not checked
    tensor_parallel_size: int = 1   # ranks the model (and each KV block) is split over
    num_kv_heads: int = 0       # the model's KV heads (all ranks); 0 = not checked
    head_dim: int = 0           # elements of one KV head of one token; 0 = not checked
    model_block_bytes: int = 0  # bytes of one block over every KV head (all ranks); 0 = block_bytes

    @classmethod
    def of(cls, engine: LLMEngine) -> Limits:
        c, runner = engine.source.config, engine.model_runner
        return cls(c.vocab_size, engine.max_model_len, engine.block_manager.num_blocks, runner.block_bytes,
                   dtype_name(runner.kv_cache_dtype), engine.config.tensor_parallel_size, c.num_key_value_heads,
                   c.head_dim, runner.block_bytes // runner.model.num_local_kv_heads * c.num_key_value_heads)


def check_token_ids(field: str, token_ids: Sequence[int], limits: Limits) -> None:
    """A prompt: non-empty, every id in the vocabulary, short enough to leave room to generate
    within the context (and so within the pool)."""
    if not token_ids:
        raise InvalidArgument(field, "must not be empty")
    if max(token_ids) >= limits.vocab_size:
        i = next(i for i, t in enumerate(token_ids) if t >= limits.vocab_size)
        raise InvalidArgument(f"{field}[{i}]", f"{token_ids[i]} is outside the vocabulary "
                                               f"[0, {limits.vocab_size})")
    if len(token_ids) >= limits.max_model_len:
        raise InvalidArgument(field, f"{len(token_ids)} tokens leave no room to generate within this "
                                     f"worker's context of {limits.max_model_len} tokens")


def check_token_id(field: str, token_id: int, limits: Limits) -> None:
    """One token id in the vocabulary."""
    if not 0 <= token_id < limits.vocab_size:
        raise InvalidArgument(field, f"{token_id} is outside the vocabulary [0, {limits.vocab_size})")


def check_params(params, limits: Limits) -> None:
    """The fields of SamplingParams that the converter cannot check without the vocabulary."""
    for i, token_id in enumerate(params.stop_token_ids):
        check_token_id(f"params.stop_token_ids[{i}]", token_id, limits)


def check_worker_id(field: str, value: str) -> None:
    """A peer's worker id: it names pair channels' store prefixes (no '/'), bounded."""
    if not value:
        raise InvalidArgument(field, "must not be empty")
    if "/" in value or len(value) > MAX_WORKER_ID_CHARS or not value.isprintable():
        raise InvalidArgument(field, f"must be at most {MAX_WORKER_ID_CHARS} printable characters without '/'")


def check_address(field: str, value: str) -> None:
    """A "host:port" address."""
    try:
        split_address(value)
    except KvTransferError as e:
        raise InvalidArgument(field, str(e)) from e


def check_prefill(request, limits: Limits) -> None:
    """A PrefillRequest: the prompt, the params, and where its KV goes (the block counts are
    checked against the prompt by the export, which knows the block size)."""
    check_token_ids("token_ids", request.token_ids, limits)
    check_params(request.params, limits)
    if not request.HasField("kv_target"):
        raise InvalidArgument("kv_target", "is required")
    target = request.kv_target
    check_worker_id("kv_target.decode_worker_id", target.decode_worker_id)
    check_address("kv_target.kv_store_address", target.kv_store_address)
    if not target.decode_address:
        raise InvalidArgument("kv_target.decode_address", "must not be empty")
