"""kvpool client library: a typed gRPC client, zero-copy attach() to the pool, and the load generator."""

from kvpool_client.client import KVPoolClient, RetryPolicy
from kvpool_client.errors import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    KVPoolClientError,
    NotFoundError,
    ResourceExhaustedError,
    UnavailableError,
)
from kvpool_client.layout import KVLayout
from kvpool_client.types import AppendResult, BlockTable, InvariantReport, PoolDescription, PoolStats

__all__ = [
    "AlreadyExistsError",
    "AppendResult",
    "BlockTable",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "InvariantReport",
    "KVLayout",
    "KVPoolClient",
    "KVPoolClientError",
    "NotFoundError",
    "PoolDescription",
    "PoolStats",
    "ResourceExhaustedError",
    "RetryPolicy",
    "UnavailableError",
]
