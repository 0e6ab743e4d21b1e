"""The core: pure Python and NumPy. It imports neither grpc nor cupy.

Layering, each module calling only those below it::

    manager.py         KVCacheManager: ids -> rows, validation; register / append / fork / free, lookups
    checks.py          check_invariants(manager), stats(manager): read-only
    block_tables.py    BlockTables: one page table row per sequence; plans appends (copy-on-write included)
    length_lookups.py  LengthLookups: per-length arrays the planners gather through
    seq_index.py       SequenceIndex: seq_id -> row, scalar and vectorised
    allocator.py       BlockAllocator: free list and reference counts
    types.py           AppendPlan, PoolStats (results, immutable)
    errors.py          the exception tree
"""

from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolationError,
    KVPoolError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
)
from kvpool_server.core.manager import KVCacheManager
from kvpool_server.core.types import AppendPlan, PoolStats

__all__ = [
    "AppendPlan",
    "BlockAllocator",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvariantViolationError",
    "KVCacheManager",
    "KVPoolError",
    "OutOfBlocksError",
    "PoolStats",
    "SequenceExistsError",
    "SequenceNotFoundError",
]
