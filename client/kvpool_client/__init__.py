"""kvpool client library: a typed gRPC client (sync and asyncio), zero-copy attach() to the pool, and the load
generator. The wire contract and the memory layout it speaks live in kvpool-common (``kvpool.v1``, ``kvpool.layout``).
"""

from kvpool.layout import KVLayout
from kvpool_client.aio import AsyncKVPoolClient
from kvpool_client.client import KVPoolClient
from kvpool_client.event_follower import AsyncEventFollower, EventFollower, fetch_snapshot
from kvpool_client.events import EventGapError, EventIndex, IndexedBlock
from kvpool_client.errors import (
    AlreadyExistsError,
    AttachNotAllowedError,
    ConnectionFailedError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVPoolClientError,
    NotFoundError,
    PermissionDeniedError,
    PoolNotMappableError,
    ResourceExhaustedError,
    ServerGoneError,
    ServerRestartedError,
    SessionLostError,
    UnauthenticatedError,
    UnavailableError,
)
from kvpool_client.retry import RetryPolicy
from kvpool_client.stream import AppendStream
from kvpool_client.types import (
    AppendResult,
    BlockTable,
    HostTierStats,
    InvariantReport,
    PoolDescription,
    PoolShard,
    PoolStats,
    RegisteredSequence,
    StepResult,
    SequenceInfo,
    SessionInfo,
    TenantUsage,
)

__all__ = [
    "AlreadyExistsError",
    "AppendResult",
    "AppendStream",
    "AsyncEventFollower",
    "AsyncKVPoolClient",
    "AttachNotAllowedError",
    "ConnectionFailedError",
    "BlockTable",
    "DeadlineExceededError",
    "EventFollower",
    "EventGapError",
    "EventIndex",
    "FailedPreconditionError",
    "HostTierStats",
    "IndexedBlock",
    "InternalError",
    "InvalidArgumentError",
    "KVLayout",
    "KVPoolClient",
    "KVPoolClientError",
    "NotFoundError",
    "PermissionDeniedError",
    "PoolNotMappableError",
    "PoolDescription",
    "PoolShard",
    "PoolStats",
    "RegisteredSequence",
    "StepResult",
    "ResourceExhaustedError",
    "RetryPolicy",
    "SequenceInfo",
    "ServerGoneError",
    "ServerRestartedError",
    "SessionInfo",
    "SessionLostError",
    "TenantUsage",
    "UnauthenticatedError",
    "UnavailableError",
    "fetch_snapshot",
]
