from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "lease_ms", "deadline_unix_ms", "router_id", "tpot_slo_ms", "kv_cache_dtype", "prefill_tensor_parallel_size", "prefill_num_kv_heads", "prefill_head_dim")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    lease_ms: int
    deadline_unix_ms: int
    router_id: str
    tpot_slo_ms: float
    kv_cache_dtype: str
    prefill_tensor_parallel_size: int
    prefill_num_kv_heads: int
    prefill_head_dim: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., lease_ms: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., router_id: _Optional[str] = ..., tpot_slo_ms: _Optional[float] = ..., kv_cache_dtype: _Optional[str] = ..., prefill_tensor_parallel_size: _Optional[int] = ..., prefill_num_kv_heads: _Optional[int] = ..., prefill_head_dim: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("block_ids", "num_cached_tokens", "kv_store_address", "worker_id", "lease_expires_unix_ms", "tensor_parallel_size")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    kv_store_address: str
    worker_id: str
    lease_expires_unix_ms: int
    tensor_parallel_size: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., kv_store_address: _Optional[str] = ..., worker_id: _Optional[str] = ..., lease_expires_unix_ms: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class KvTarget(_message.Message):
    __slots__ = ("decode_worker_id", "kv_store_address", "decode_address", "block_ids", "num_cached_tokens", "decode_tensor_parallel_size")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    kv_store_address: str
    decode_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    decode_tensor_parallel_size: int
    def __init__(self, decode_worker_id: _Optional[str] = ..., kv_store_address: _Optional[str] = ..., decode_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., decode_tensor_parallel_size: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "deadline_unix_ms", "kv_target")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TARGET_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    deadline_unix_ms: int
    kv_target: KvTarget
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., kv_target: _Optional[_Union[KvTarget, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "num_cached_tokens", "finish_reason", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    num_cached_tokens: int
    finish_reason: _common_pb2.FinishReason
    top_logprobs: _common_pb2.TopLogprobs
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., top_logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("bytes", "transfer_ms", "num_blocks")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    transfer_ms: float
    num_blocks: int
    def __init__(self, bytes: _Optional[int] = ..., transfer_ms: _Optional[float] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class PushKVRequest(_message.Message):
    __slots__ = ("request_id", "prefill_worker_id", "channel_epoch", "first_token_id", "first_token_logprob", "num_blocks", "block_ids", "num_bytes", "first_token_on_channel", "pair_secret", "prefill_tensor_parallel_size")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ON_CHANNEL_FIELD_NUMBER: _ClassVar[int]
    PAIR_SECRET_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill_worker_id: str
    channel_epoch: int
    first_token_id: int
    first_token_logprob: float
    num_blocks: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_bytes: int
    first_token_on_channel: bool
    pair_secret: str
    prefill_tensor_parallel_size: int
    def __init__(self, request_id: _Optional[str] = ..., prefill_worker_id: _Optional[str] = ..., channel_epoch: _Optional[int] = ..., first_token_id: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., num_blocks: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_bytes: _Optional[int] = ..., first_token_on_channel: _Optional[bool] = ..., pair_secret: _Optional[str] = ..., prefill_tensor_parallel_size: _Optional[int] = ...) -> None: ...

class PushKVResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "deadline_unix_ms", "router_id", "tpot_slo_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    deadline_unix_ms: int
    router_id: str
    tpot_slo_ms: float
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., router_id: _Optional[str] = ..., tpot_slo_ms: _Optional[float] = ...) -> None: ...

class SubmitResponse(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("router_id",)
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    def __init__(self, router_id: _Optional[str] = ...) -> None: ...

class StepOutputs(_message.Message):
    __slots__ = ("outputs", "step")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    step: int
    def __init__(self, outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., step: _Optional[int] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "error", "top_logprobs", "prompt_logprobs", "prompt_top_logprobs", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    error: str
    top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    prompt_top_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    index: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., error: _Optional[str] = ..., top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ..., prompt_top_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("router_id", "request_ids")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, router_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("lost",)
    LOST_FIELD_NUMBER: _ClassVar[int]
    lost: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lost: _Optional[_Iterable[str]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("num_free_blocks", "num_used_blocks", "num_total_blocks", "num_cached_blocks", "num_waiting", "num_running", "num_reserved", "prefix_cache_hit_tokens", "prefix_cache_query_tokens", "num_preemptions", "role", "worker_id", "num_kv_transfers", "kv_transfer_bytes", "num_waiting_prefill_tokens", "num_running_context_tokens", "prefill_tokens_per_s", "decode_step_ms", "max_num_batched_tokens", "chunked_prefill", "mixed_step_ms", "mixed_prompt_tokens", "ms_per_prompt_token", "tpot_target_ms", "num_open_kv_channels", "num_kv_channels_opened", "tensor_parallel_size")
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNKED_PREFILL_FIELD_NUMBER: _ClassVar[int]
    MIXED_STEP_MS_FIELD_NUMBER: _ClassVar[int]
    MIXED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MS_PER_PROMPT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_OPEN_KV_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_CHANNELS_OPENED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    num_free_blocks: int
    num_used_blocks: int
    num_total_blocks: int
    num_cached_blocks: int
    num_waiting: int
    num_running: int
    num_reserved: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_preemptions: int
    role: _common_pb2.Role
    worker_id: str
    num_kv_transfers: int
    kv_transfer_bytes: int
    num_waiting_prefill_tokens: int
    num_running_context_tokens: int
    prefill_tokens_per_s: float
    decode_step_ms: float
    max_num_batched_tokens: int
    chunked_prefill: bool
    mixed_step_ms: float
    mixed_prompt_tokens: float
    ms_per_prompt_token: float
    tpot_target_ms: float
    num_open_kv_channels: int
    num_kv_channels_opened: int
    tensor_parallel_size: int
    def __init__(self, num_free_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_reserved: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_query_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., role: _Optional[_Union[_common_pb2.Role, str]] = ..., worker_id: _Optional[str] = ..., num_kv_transfers: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., num_waiting_prefill_tokens: _Optional[int] = ..., num_running_context_tokens: _Optional[int] = ..., prefill_tokens_per_s: _Optional[float] = ..., decode_step_ms: _Optional[float] = ..., max_num_batched_tokens: _Optional[int] = ..., chunked_prefill: _Optional[bool] = ..., mixed_step_ms: _Optional[float] = ..., mixed_prompt_tokens: _Optional[float] = ..., ms_per_prompt_token: _Optional[float] = ..., tpot_target_ms: _Optional[float] = ..., num_open_kv_channels: _Optional[int] = ..., num_kv_channels_opened: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("stored", "evicted", "snapshot", "worker_id", "seq", "num_total_blocks")
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[int]
    evicted: _containers.RepeatedScalarFieldContainer[int]
    snapshot: bool
    worker_id: str
    seq: int
    num_total_blocks: int
    def __init__(self, stored: _Optional[_Iterable[int]] = ..., evicted: _Optional[_Iterable[int]] = ..., snapshot: _Optional[bool] = ..., worker_id: _Optional[str] = ..., seq: _Optional[int] = ..., num_total_blocks: _Optional[int] = ...) -> None: ...
