"""kvpool client library: a typed gRPC client (sync and asyncio), zero-copy attach() to the pool, and the load
generator.

Names are imported on first use (PEP 562), so ``kvpool_client.layout`` -- which the server's device layer shares --
loads without grpc.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncKVPoolClient": "kvpool_client.aio",
    "AppendStream": "kvpool_client.stream",
    "KVPoolClient": "kvpool_client.client",
    "RetryPolicy": "kvpool_client.client",
    "AlreadyExistsError": "kvpool_client.errors",
    "DeadlineExceededError": "kvpool_client.errors",
    "FailedPreconditionError": "kvpool_client.errors",
    "InternalError": "kvpool_client.errors",
    "InvalidArgumentError": "kvpool_client.errors",
    "KVPoolClientError": "kvpool_client.errors",
    "NotFoundError": "kvpool_client.errors",
    "ResourceExhaustedError": "kvpool_client.errors",
    "UnavailableError": "kvpool_client.errors",
    "KVLayout": "kvpool_client.layout",
    "AppendResult": "kvpool_client.types",
    "BlockTable": "kvpool_client.types",
    "InvariantReport": "kvpool_client.types",
    "PoolDescription": "kvpool_client.types",
    "PoolStats": "kvpool_client.types",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpool_client' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from kvpool_client.aio import AsyncKVPoolClient
    from kvpool_client.client import KVPoolClient, RetryPolicy
    from kvpool_client.stream import AppendStream
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
