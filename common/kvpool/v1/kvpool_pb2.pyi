from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Backend(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BACKEND_UNSPECIFIED: _ClassVar[Backend]
    BACKEND_GPU: _ClassVar[Backend]
    BACKEND_HOST: _ClassVar[Backend]

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_BFLOAT16: _ClassVar[Dtype]

class KvLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_LAYOUT_UNSPECIFIED: _ClassVar[KvLayout]
    KV_LAYOUT_BLOCK_MAJOR: _ClassVar[KvLayout]
    KV_LAYOUT_LAYER_MAJOR: _ClassVar[KvLayout]
BACKEND_UNSPECIFIED: Backend
BACKEND_GPU: Backend
BACKEND_HOST: Backend
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_BFLOAT16: Dtype
KV_LAYOUT_UNSPECIFIED: KvLayout
KV_LAYOUT_BLOCK_MAJOR: KvLayout
KV_LAYOUT_LAYER_MAJOR: KvLayout

class RegisterSequenceRequest(_message.Message):
    __slots__ = ("seq_id", "session_id", "request_id", "prompt_token_ids", "public_prefix_len", "cache_extra_key")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    session_id: int
    request_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    public_prefix_len: int
    cache_extra_key: bytes
    def __init__(self, seq_id: _Optional[int] = ..., session_id: _Optional[int] = ..., request_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., public_prefix_len: _Optional[int] = ..., cache_extra_key: _Optional[bytes] = ...) -> None: ...

class RegisterSequenceResponse(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_cached_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class RegisterSequencesRequest(_message.Message):
    __slots__ = ("session_id", "request_id", "prompts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    request_id: int
    prompts: _containers.RepeatedCompositeFieldContainer[SequencePrompt]
    def __init__(self, session_id: _Optional[int] = ..., request_id: _Optional[int] = ..., prompts: _Optional[_Iterable[_Union[SequencePrompt, _Mapping]]] = ...) -> None: ...

class SequencePrompt(_message.Message):
    __slots__ = ("prompt_token_ids", "public_prefix_len", "cache_extra_key")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    public_prefix_len: int
    cache_extra_key: bytes
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., public_prefix_len: _Optional[int] = ..., cache_extra_key: _Optional[bytes] = ...) -> None: ...

class RegisterSequencesResponse(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[RegisteredSequence]
    def __init__(self, sequences: _Optional[_Iterable[_Union[RegisteredSequence, _Mapping]]] = ...) -> None: ...

class RegisteredSequence(_message.Message):
    __slots__ = ("seq_id", "num_cached_tokens", "cached_block_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    num_cached_tokens: int
    cached_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., cached_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendTokenRequest(_message.Message):
    __slots__ = ("seq_ids", "num_tokens", "session_id", "request_id", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    session_id: int
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., session_id: _Optional[int] = ..., request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("src_block_id", "dst_block_id")
    SRC_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_ID_FIELD_NUMBER: _ClassVar[int]
    src_block_id: int
    dst_block_id: int
    def __init__(self, src_block_id: _Optional[int] = ..., dst_block_id: _Optional[int] = ...) -> None: ...

class AppendTokenResponse(_message.Message):
    __slots__ = ("slot_mapping", "new_block_ids", "copies")
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, slot_mapping: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class AppendTokenStreamRequest(_message.Message):
    __slots__ = ("seq_ids", "num_tokens", "session_id", "request_id", "token_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    session_id: int
    request_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., session_id: _Optional[int] = ..., request_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendTokenStreamResponse(_message.Message):
    __slots__ = ("slot_mapping", "new_block_ids", "copies")
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, slot_mapping: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("parent_seq_id", "num_children", "child_seq_ids", "session_id", "request_id")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHILDREN_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    num_children: int
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: int
    request_id: int
    def __init__(self, parent_seq_id: _Optional[int] = ..., num_children: _Optional[int] = ..., child_seq_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class ForkResponse(_message.Message):
    __slots__ = ("child_seq_ids",)
    CHILD_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    child_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, child_seq_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids", "session_id", "request_id")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    session_id: int
    request_id: int
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., session_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class FreeResponse(_message.Message):
    __slots__ = ("num_blocks_freed",)
    NUM_BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_freed: int
    def __init__(self, num_blocks_freed: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("num_blocks_total", "num_blocks_free", "num_blocks_used", "utilization", "num_tokens", "num_slots_unused", "internal_fragmentation", "num_blocks_shared", "num_copies", "num_sequences", "block_size", "block_bytes", "tenants", "num_blocks_evictable", "prefix_query_tokens", "prefix_hit_tokens", "prefix_host_hit_tokens", "host_tier", "num_tokens_appended", "num_blocks_evicted")
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_UNUSED_FIELD_NUMBER: _ClassVar[int]
    INTERNAL_FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_SHARED_FIELD_NUMBER: _ClassVar[int]
    NUM_COPIES_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HOST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_APPENDED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_used: int
    utilization: float
    num_tokens: int
    num_slots_unused: int
    internal_fragmentation: float
    num_blocks_shared: int
    num_copies: int
    num_sequences: int
    block_size: int
    block_bytes: int
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    num_blocks_evictable: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_host_hit_tokens: int
    host_tier: HostTierStats
    num_tokens_appended: int
    num_blocks_evicted: int
    def __init__(self, num_blocks_total: _Optional[int] = ..., num_blocks_free: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., utilization: _Optional[float] = ..., num_tokens: _Optional[int] = ..., num_slots_unused: _Optional[int] = ..., internal_fragmentation: _Optional[float] = ..., num_blocks_shared: _Optional[int] = ..., num_copies: _Optional[int] = ..., num_sequences: _Optional[int] = ..., block_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., num_blocks_evictable: _Optional[int] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_host_hit_tokens: _Optional[int] = ..., host_tier: _Optional[_Union[HostTierStats, _Mapping]] = ..., num_tokens_appended: _Optional[int] = ..., num_blocks_evicted: _Optional[int] = ...) -> None: ...

class HostTierStats(_message.Message):
    __slots__ = ("num_blocks", "bytes_total", "num_blocks_ready", "bytes_ready", "num_blocks_used", "num_blocks_cached", "num_blocks_offloaded", "num_blocks_written_back", "num_blocks_restored", "bytes_offloaded", "offload_seconds", "bytes_restored", "restore_seconds", "num_offload_failures", "num_blocks_fenced", "num_blocks_torn", "num_blocks_dropped", "num_evictions_unkept")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_READY_FIELD_NUMBER: _ClassVar[int]
    BYTES_READY_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_WRITTEN_BACK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_OFFLOADED_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESTORED_FIELD_NUMBER: _ClassVar[int]
    RESTORE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OFFLOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FENCED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_TORN_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_UNKEPT_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    bytes_total: int
    num_blocks_ready: int
    bytes_ready: int
    num_blocks_used: int
    num_blocks_cached: int
    num_blocks_offloaded: int
    num_blocks_written_back: int
    num_blocks_restored: int
    bytes_offloaded: int
    offload_seconds: float
    bytes_restored: int
    restore_seconds: float
    num_offload_failures: int
    num_blocks_fenced: int
    num_blocks_torn: int
    num_blocks_dropped: int
    num_evictions_unkept: int
    def __init__(self, num_blocks: _Optional[int] = ..., bytes_total: _Optional[int] = ..., num_blocks_ready: _Optional[int] = ..., bytes_ready: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_cached: _Optional[int] = ..., num_blocks_offloaded: _Optional[int] = ..., num_blocks_written_back: _Optional[int] = ..., num_blocks_restored: _Optional[int] = ..., bytes_offloaded: _Optional[int] = ..., offload_seconds: _Optional[float] = ..., bytes_restored: _Optional[int] = ..., restore_seconds: _Optional[float] = ..., num_offload_failures: _Optional[int] = ..., num_blocks_fenced: _Optional[int] = ..., num_blocks_torn: _Optional[int] = ..., num_blocks_dropped: _Optional[int] = ..., num_evictions_unkept: _Optional[int] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "num_sequences", "num_blocks", "num_sessions", "max_blocks", "max_sequences", "max_sessions", "reserved_blocks")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    num_sequences: int
    num_blocks: int
    num_sessions: int
    max_blocks: int
    max_sequences: int
    max_sessions: int
    reserved_blocks: int
    def __init__(self, tenant: _Optional[str] = ..., num_sequences: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_sessions: _Optional[int] = ..., max_blocks: _Optional[int] = ..., max_sequences: _Optional[int] = ..., max_sessions: _Optional[int] = ..., reserved_blocks: _Optional[int] = ...) -> None: ...

class GetBlockTableRequest(_message.Message):
    __slots__ = ("seq_id",)
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    def __init__(self, seq_id: _Optional[int] = ...) -> None: ...

class GetBlockTableResponse(_message.Message):
    __slots__ = ("block_ids", "num_tokens", "block_size", "block_hashes")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    block_size: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., block_size: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PoolLayout(_message.Message):
    __slots__ = ("num_blocks", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "block_bytes", "token_bytes", "kv_layout")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: Dtype
    block_bytes: int
    token_bytes: int
    kv_layout: KvLayout
    def __init__(self, num_blocks: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., block_bytes: _Optional[int] = ..., token_bytes: _Optional[int] = ..., kv_layout: _Optional[_Union[KvLayout, str]] = ...) -> None: ...

class DescribePoolRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribePoolResponse(_message.Message):
    __slots__ = ("layout", "backend", "pool_bytes", "cuda_ipc_handle", "cuda_device", "shm_name", "server_pid", "tensor_parallel", "shards")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SERVER_PID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    layout: PoolLayout
    backend: Backend
    pool_bytes: int
    cuda_ipc_handle: bytes
    cuda_device: int
    shm_name: str
    server_pid: int
    tensor_parallel: int
    shards: _containers.RepeatedCompositeFieldContainer[PoolShard]
    def __init__(self, layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., backend: _Optional[_Union[Backend, str]] = ..., pool_bytes: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_device: _Optional[int] = ..., shm_name: _Optional[str] = ..., server_pid: _Optional[int] = ..., tensor_parallel: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[PoolShard, _Mapping]]] = ...) -> None: ...

class PoolShard(_message.Message):
    __slots__ = ("rank", "first_kv_head", "num_kv_heads", "pool_bytes", "block_bytes", "cuda_ipc_handle", "cuda_device", "shm_name")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_KV_HEAD_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    first_kv_head: int
    num_kv_heads: int
    pool_bytes: int
    block_bytes: int
    cuda_ipc_handle: bytes
    cuda_device: int
    shm_name: str
    def __init__(self, rank: _Optional[int] = ..., first_kv_head: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., cuda_ipc_handle: _Optional[bytes] = ..., cuda_device: _Optional[int] = ..., shm_name: _Optional[str] = ...) -> None: ...

class WriteKVRequest(_message.Message):
    __slots__ = ("seq_id", "start_position", "data", "session_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    data: bytes
    session_id: int
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., data: _Optional[bytes] = ..., session_id: _Optional[int] = ...) -> None: ...

class WriteKVResponse(_message.Message):
    __slots__ = ("num_tokens_written",)
    NUM_TOKENS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    num_tokens_written: int
    def __init__(self, num_tokens_written: _Optional[int] = ...) -> None: ...

class ReadKVRequest(_message.Message):
    __slots__ = ("seq_id", "start_position", "num_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    start_position: int
    num_tokens: int
    def __init__(self, seq_id: _Optional[int] = ..., start_position: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class ReadKVResponse(_message.Message):
    __slots__ = ("data", "num_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    num_tokens: int
    def __init__(self, data: _Optional[bytes] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class CheckInvariantsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckInvariantsResponse(_message.Message):
    __slots__ = ("ok", "num_blocks_checked", "num_sequences_checked")
    OK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    num_blocks_checked: int
    num_sequences_checked: int
    def __init__(self, ok: _Optional[bool] = ..., num_blocks_checked: _Optional[int] = ..., num_sequences_checked: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("client_name", "lease_ttl_ms")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    lease_ttl_ms: int
    def __init__(self, client_name: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "server_epoch", "lease_ttl_ms")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    server_epoch: int
    lease_ttl_ms: int
    def __init__(self, session_id: _Optional[int] = ..., server_epoch: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("lease_remaining_ms",)
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    lease_remaining_ms: int
    def __init__(self, lease_remaining_ms: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("num_sequences_freed", "num_blocks_freed")
    NUM_SEQUENCES_FREED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    num_sequences_freed: int
    num_blocks_freed: int
    def __init__(self, num_sequences_freed: _Optional[int] = ..., num_blocks_freed: _Optional[int] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "client_name", "opened_unix_ms", "lease_ttl_ms", "lease_remaining_ms", "keep_alive_open", "num_sequences", "num_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    OPENED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_OPEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    client_name: str
    opened_unix_ms: int
    lease_ttl_ms: int
    lease_remaining_ms: int
    keep_alive_open: bool
    num_sequences: int
    num_blocks: int
    def __init__(self, session_id: _Optional[int] = ..., client_name: _Optional[str] = ..., opened_unix_ms: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., lease_remaining_ms: _Optional[int] = ..., keep_alive_open: _Optional[bool] = ..., num_sequences: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "server_epoch", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SERVER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    server_epoch: int
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., server_epoch: _Optional[int] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class ListSequencesRequest(_message.Message):
    __slots__ = ("session_id", "page_size", "page_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    page_size: int
    page_token: str
    def __init__(self, session_id: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SequenceInfo(_message.Message):
    __slots__ = ("seq_id", "session_id", "num_tokens", "num_blocks")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    session_id: int
    num_tokens: int
    num_blocks: int
    def __init__(self, seq_id: _Optional[int] = ..., session_id: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class ListSequencesResponse(_message.Message):
    __slots__ = ("sequences", "next_page_token")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInfo]
    next_page_token: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("resume",)
    RESUME_FIELD_NUMBER: _ClassVar[int]
    resume: bool
    def __init__(self, resume: _Optional[bool] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_sessions", "num_sequences")
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    num_sessions: int
    num_sequences: int
    def __init__(self, num_sessions: _Optional[int] = ..., num_sequences: _Optional[int] = ...) -> None: ...

class SubscribeEventsRequest(_message.Message):
    __slots__ = ("from_seq", "epoch")
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    epoch: int
    def __init__(self, from_seq: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class SubscribeEventsResponse(_message.Message):
    __slots__ = ("epoch", "seq", "events", "snapshot", "num_dropped")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    NUM_DROPPED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    seq: int
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    snapshot: bool
    num_dropped: int
    def __init__(self, epoch: _Optional[int] = ..., seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., snapshot: _Optional[bool] = ..., num_dropped: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "cache_extra_key", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    CACHE_EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    cache_extra_key: bytes
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., cache_extra_key: _Optional[bytes] = ..., medium: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenFastPathRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class OpenFastPathResponse(_message.Message):
    __slots__ = ("shm_name", "socket_address", "token", "segment_bytes", "area_bytes", "generation", "max_batch")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SOCKET_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    AREA_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    socket_address: str
    token: bytes
    segment_bytes: int
    area_bytes: int
    generation: int
    max_batch: int
    def __init__(self, shm_name: _Optional[str] = ..., socket_address: _Optional[str] = ..., token: _Optional[bytes] = ..., segment_bytes: _Optional[int] = ..., area_bytes: _Optional[int] = ..., generation: _Optional[int] = ..., max_batch: _Optional[int] = ...) -> None: ...
