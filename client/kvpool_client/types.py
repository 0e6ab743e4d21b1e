"""What the client returns: small frozen dataclasses and NumPy arrays, never protobuf messages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.layout import KVLayout


@dataclass(frozen=True)
class AppendResult:
    """The answer to one AppendToken.

    slot_mapping:  int64 [sum(num_tokens)], the new tokens' slots, grouped by sequence in request order::

                       seq_ids    = (7,        9)
                       num_tokens = [3,        1]
                       slots      = [s s s  |  s]

    new_block_ids: int64 [k], blocks this call allocated (copy-on-write destinations included).
    copies:        int64 [c, 2], (src_block_id, dst_block_id) copies the server ran before it replied.
    """

    seq_ids: tuple[int, ...]
    num_tokens: np.ndarray
    slot_mapping: np.ndarray
    new_block_ids: np.ndarray
    copies: np.ndarray

    @property
    def offsets(self) -> np.ndarray:
        """Where each sequence's slots start in ``slot_mapping`` (length len(seq_ids) + 1)."""
        return np.concatenate(([0], np.cumsum(self.num_tokens)))

    def split(self) -> dict[int, np.ndarray]:
        """seq_id -> its slots (views into slot_mapping)."""
        bounds = self.offsets
        return {seq_id: self.slot_mapping[bounds[i] : bounds[i + 1]] for i, seq_id in enumerate(self.seq_ids)}

    def slots_of(self, seq_id: int) -> np.ndarray:
        i = self.seq_ids.index(seq_id)
        bounds = self.offsets
        return self.slot_mapping[bounds[i] : bounds[i + 1]]


@dataclass(frozen=True)
class RegisteredSequence:
    """One sequence of ``register_prompts``: it starts with ``num_cached_tokens`` cached tokens, held by the blocks
    ``cached_block_ids`` (int32, logical order: ``num_cached_tokens // block_size`` of them)."""

    seq_id: int
    num_cached_tokens: int
    cached_block_ids: np.ndarray


@dataclass(frozen=True)
class BlockTable:
    """A sequence's page table: ``block_ids[i]`` holds tokens [i * block_size, (i + 1) * block_size)."""

    block_ids: np.ndarray
    num_tokens: int
    block_size: int

    def slots(self, start: int = 0, count: int | None = None) -> np.ndarray:
        """Slots (block_id * block_size + offset) of tokens [start, start + count), int64."""
        stop = self.num_tokens if count is None else start + count
        if not 0 <= start <= stop <= self.num_tokens:
            raise ValueError(f"tokens [{start}, {stop}) are outside a sequence of {self.num_tokens} tokens")
        positions = np.arange(start, stop, dtype=np.int64)
        return self.block_ids[positions // self.block_size] * self.block_size + positions % self.block_size


@dataclass(frozen=True)
class TenantUsage:
    """One tenant's share of the pool and its quotas, as Stats reports it: a quota of None is no limit, 0 is none
    allowed (as in the server's tokens file)."""

    tenant: str
    num_sequences: int
    num_blocks: int  # distinct blocks its sequences hold
    num_sessions: int
    max_blocks: int | None
    max_sequences: int | None
    max_sessions: int | None
    reserved_blocks: int


@dataclass(frozen=True)
class HostTierStats:
    """The host tier's figures, as StatsResponse.host_tier reports them (see the proto for each field): blocks of
    the pool's size; counts, bytes and seconds since the server started."""

    num_blocks: int
    bytes_total: int
    num_blocks_ready: int  # allocated (pinned) so far: the tier is allocated in the background
    bytes_ready: int
    num_blocks_used: int
    num_blocks_cached: int  # matchable
    num_blocks_offloaded: int
    num_blocks_written_back: int
    num_blocks_restored: int
    bytes_offloaded: int
    offload_seconds: float
    bytes_restored: int
    restore_seconds: float
    num_offload_failures: int
    num_blocks_fenced: int  # restores that failed: slots dropped, a miss
    num_blocks_torn: int  # write-backs overtaken by an eviction: aborted
    num_blocks_dropped: int  # dropped by the host LRU
    num_evictions_unkept: int  # evicted pool blocks the tier did not keep

    @property
    def offload_bytes_per_s(self) -> float:
        """The offloads' bandwidth since start (0 before any)."""
        return self.bytes_offloaded / self.offload_seconds if self.offload_seconds > 0 else 0.0

    @property
    def restore_bytes_per_s(self) -> float:
        return self.bytes_restored / self.restore_seconds if self.restore_seconds > 0 else 0.0


@dataclass(frozen=True)
class PoolStats:
    """Pool occupancy, as StatsResponse reports it (see the proto for each field)."""

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
    # The caller's own tenant (a frontend token) or every tenant (admin); empty on a server without --auth-tokens
    tenants: tuple[TenantUsage, ...] = ()
    num_blocks_evictable: int = 0  # cached blocks no sequence holds (prefix caching)
    prefix_query_tokens: int = 0  # prompt tokens looked up in the prefix cache since start
    prefix_hit_tokens: int = 0  # of those, found cached (either tier)
    prefix_host_hit_tokens: int = 0  # of the hits, restored from the host tier
    num_tokens_appended: int = 0  # tokens appended since start (0 from a server that predates the count)
    num_blocks_evicted: int = 0  # cached blocks evicted from the prefix cache since start
    host_tier: HostTierStats | None = None  # None: the server has no host tier (or predates it)

    @property
    def bytes_used(self) -> int:
        """Pool bytes in used blocks (kvctl shows it)."""
        return self.num_blocks_used * self.block_bytes


@dataclass(frozen=True)
class PoolShard:
    """One rank's shard of a tensor-parallel pool (DescribePool's ``shards``): the heads ``heads`` of the full layout
    for every block, laid out as ``layout`` (the full layout with ``len(heads)`` heads), and what maps it."""

    rank: int
    heads: range
    layout: KVLayout
    pool_bytes: int
    shm_name: str
    cuda_ipc_handle: bytes
    cuda_device: int


@dataclass(frozen=True)
class PoolDescription:
    """DescribePool: the layout and how to map the pool (shm_name on the host backend, CUDA IPC on a GPU).

    With ``tensor_parallel`` N > 1 the pool is N shards split by KV heads (``shards``, rank order); ``layout`` is the
    full layout (WriteKV/ReadKV's format) and the single attach fields are rank 0's. ``for_rank(r)`` describes rank
    r's shard as a pool of its own (what ``attach(rank=r)`` maps)."""

    layout: KVLayout
    num_blocks: int
    backend: str  # "gpu" | "host"
    pool_bytes: int
    block_bytes: int
    token_bytes: int
    shm_name: str
    cuda_ipc_handle: bytes
    cuda_device: int
    server_pid: int
    tensor_parallel: int = 1
    shards: tuple[PoolShard, ...] = ()

    @property
    def group_bytes(self) -> int:
        """The bytes of every rank's shard together (``pool_bytes`` is rank 0's when the pool is split)."""
        return sum(s.pool_bytes for s in self.shards) if self.shards else self.pool_bytes

    def for_rank(self, rank: int) -> PoolDescription:
        """Rank ``rank``'s shard as a pool of its own: its layout (its heads only), size and mapping."""
        if not 0 <= rank < max(1, len(self.shards)):
            raise ValueError(f"rank must be in [0, {max(1, len(self.shards))}), got {rank}")
        if not self.shards:
            return self
        s = self.shards[rank]
        return dataclasses.replace(
            self, layout=s.layout, pool_bytes=s.pool_bytes, block_bytes=s.layout.block_bytes,
            token_bytes=s.layout.token_bytes, shm_name=s.shm_name, cuda_ipc_handle=s.cuda_ipc_handle,
            cuda_device=s.cuda_device, tensor_parallel=1, shards=(dataclasses.replace(s, rank=0),))


@dataclass(frozen=True)
class InvariantReport:
    ok: bool
    num_blocks_checked: int
    num_sequences_checked: int


@dataclass(frozen=True)
class SessionInfo:
    """One live session, as ListSessions reports it."""

    session_id: int
    client_name: str
    opened_unix_ms: int
    lease_ttl_ms: int
    lease_remaining_ms: int
    keep_alive_open: bool
    num_sequences: int
    num_blocks: int


@dataclass(frozen=True)
class SequenceInfo:
    """One live sequence, as ListSequences reports it (session_id 0: it belongs to no session)."""

    session_id: int
    seq_id: int
    num_tokens: int
    num_blocks: int


@dataclass(frozen=True)
class StepResult:
    """The answer to ``step``: each part's -- its result, the ``KVPoolClientError`` the server refused it with
    (nothing of that part applied), or None where the step had no such part. ``value(part)`` gives the result or
    raises the error."""

    freed: Any = None  # int: the Free's blocks freed
    appended: Any = None  # AppendResult
    registered: Any = None  # list[RegisteredSequence]

    def value(self, part: str) -> Any:
        answer = getattr(self, part)
        if isinstance(answer, Exception):
            raise answer
        return answer
