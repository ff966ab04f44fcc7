"""The decode worker's checks of Reserve, Submit and PushKV, made as if each came from a
stranger (see pdserve.prefill_worker.validation, whose :class:`Limits` and prompt checks these
build on). A bad field raises InvalidArgument naming it, before any block moves; what needs the
request's state (the reservation's block ids, the channel's epoch) is checked with that state.
"""
from __future__ import annotations

import math

from pdserve.common.grpc_utils.errors import FailedPrecondition, InvalidArgument
from pdserve.common.kv_transfer.layout import KvLayout, Route, pair_error, routes
from pdserve.prefill_worker.validation import Limits, check_params, check_token_id, check_token_ids, check_worker_id

#: Longest reservation lease accepted (ms): blocks pinned longer than this are a bug or an attack.
MAX_LEASE_MS = 3_600_000
#: Largest per-request TPOT objective accepted (ms), as the router's (pdserve.router.slo).
MAX_TPOT_SLO_MS = 3_600_000.0
#: Largest tensor-parallel size a peer may announce (its ranks name channels and threads here).
MAX_TENSOR_PARALLEL_SIZE = 64


def check_reserve(request, limits: Limits) -> None:
    """A ReserveRequest: prompt, params, lease, and the prefill worker's KV cache dtype, which
    must be this worker's (FailedPrecondition naming both: its blocks would not read back here)."""
    check_kv_cache_dtype(request.kv_cache_dtype, limits)
    check_kv_layout(KvLayout(request.prefill_tensor_parallel_size or 1, request.prefill_num_kv_heads,
                             request.prefill_head_dim, request.kv_cache_dtype), limits)
    check_token_ids("token_ids", request.token_ids, limits)
    check_params(request.params, limits)
    check_tpot_slo(request.tpot_slo_ms)
    if request.lease_ms > MAX_LEASE_MS:
        raise InvalidArgument("lease_ms", f"{request.lease_ms} is over the maximum of {MAX_LEASE_MS}")


def check_kv_cache_dtype(sender: str, limits: Limits) -> None:
    """The prefill worker's KV cache dtype ``sender`` ("" = not given) against this worker's."""
    if sender and limits.kv_cache_dtype and sender != limits.kv_cache_dtype:
        raise FailedPrecondition(f"KV cache dtype mismatch: the prefill worker's cache is {sender}, this decode "
                                 f"worker's is {limits.kv_cache_dtype}; every worker of a deployment must run "
                                 f"with the same --kv-cache-dtype (and --dtype)")


def decode_layout(limits: Limits) -> KvLayout:
    """This worker's KV layout (what a prefill worker's must pair with)."""
    return KvLayout(limits.tensor_parallel_size, limits.num_kv_heads, limits.head_dim, limits.kv_cache_dtype)


def check_kv_layout(prefill: KvLayout, limits: Limits) -> None:
    """The prefill worker's KV layout against this worker's: any split over ranks pairs with any
    other (each rank ships its heads to the ranks that hold them), but the KV heads, their size
    and the cache dtype must agree (FailedPrecondition naming both layouts otherwise)."""
    decode = decode_layout(limits)
    why = pair_error(prefill, decode)
    if why is None and prefill.tensor_parallel_size != 1 and decode.num_kv_heads:
        try:    # the prefill worker's ranks must split this model's KV heads
            routes(KvLayout(prefill.tensor_parallel_size, decode.num_kv_heads, decode.head_dim), decode)
        except ValueError as e:
            why = (f"KV layouts cannot be paired: the prefill worker's {prefill.tensor_parallel_size} ranks cannot "
                   f"split the KV heads of this decode worker's {decode} ({e})")
    if why is not None:
        raise FailedPrecondition(why)


def push_routes(request, limits: Limits) -> list[Route]:
    """The routes of a PushKV's transfer from its prefill worker's ranks to this worker's
    (InvalidArgument for a tensor-parallel size the model's KV heads cannot be split over)."""
    tp = request.prefill_tensor_parallel_size or 1
    if tp == 1 and limits.tensor_parallel_size == 1:
        return [Route(0, 0, (0, limits.num_kv_heads), (0, limits.num_kv_heads))]
    if tp > MAX_TENSOR_PARALLEL_SIZE:
        raise InvalidArgument("prefill_tensor_parallel_size", f"{tp} is over {MAX_TENSOR_PARALLEL_SIZE}")
    layout = decode_layout(limits)
    try:
        return routes(KvLayout(tp, layout.num_kv_heads, layout.head_dim), layout)
    except ValueError as e:
        raise InvalidArgument("prefill_tensor_parallel_size", str(e)) from e


def check_submit(request, limits: Limits) -> None:
    """A SubmitRequest: prompt, params, TPOT objective."""
    check_token_ids("token_ids", request.token_ids, limits)
    check_params(request.params, limits)
    check_tpot_slo(request.tpot_slo_ms)


def check_tpot_slo(value: float) -> None:
    """A request's own TPOT objective: 0 (the worker's) or finite in (0, MAX_TPOT_SLO_MS]."""
    if not math.isfinite(value) or not 0.0 <= value <= MAX_TPOT_SLO_MS:
        raise InvalidArgument("tpot_slo_ms", f"must be 0 or a finite number of ms up to {MAX_TPOT_SLO_MS:g}, "
                                             f"not {value!r}")


def check_push_kv(request, limits: Limits) -> None:
    """A PushKVRequest: the sender's id, the block list against the pool, the byte count
    against this worker's block geometry, and the first token when it travels in the call
    (one that travels on the channel is checked when it lands: DecodeState.finish_receive)."""
    check_worker_id("prefill_worker_id", request.prefill_worker_id)
    block_ids = request.block_ids
    if request.num_blocks != len(block_ids):
        raise InvalidArgument("num_blocks", f"{request.num_blocks} != len(block_ids) {len(block_ids)}")
    if len(block_ids) > limits.num_blocks:
        raise InvalidArgument("block_ids", f"{len(block_ids)} ids for a pool of {limits.num_blocks} blocks")
    if block_ids and max(block_ids) >= limits.num_blocks:
        raise InvalidArgument("block_ids", f"id {max(block_ids)} is outside the pool [0, {limits.num_blocks})")
    push_routes(request, limits)
    expected_bytes = len(block_ids) * (limits.model_block_bytes or limits.block_bytes)
    if request.num_bytes and request.num_bytes != expected_bytes:
        raise InvalidArgument("num_bytes", f"{request.num_bytes} != {expected_bytes} for {len(block_ids)} "
                                           f"blocks of this worker's geometry")
    if request.first_token_on_channel:
        if not block_ids:
            raise InvalidArgument("first_token_on_channel", "needs at least one block to follow")
        return
    check_token_id("first_token_id", request.first_token_id, limits)
    if math.isnan(request.first_token_logprob):
        raise InvalidArgument("first_token_logprob", "must be a number, got NaN")
