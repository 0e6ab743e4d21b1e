"""The core: pure Python and NumPy. It imports neither grpc nor cupy.

Layering, each module calling only those below it::

    batch.py         SequenceBatch: a persistent decode batch over the manager
    manager.py       KVCacheManager: register / append / fork / free, plans copies
    block_tables.py  BlockTables: one page table row per sequence, token counts
    seq_index.py     SequenceIndex: seq_id -> row, scalar and vectorised
    allocator.py     BlockAllocator: free list and reference counts
    types.py         AppendPlan, TokenAddress, PoolStats (results, frozen)
    errors.py        the exception tree
"""

from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.batch import SequenceBatch
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
from kvpool_server.core.types import AppendPlan, PoolStats, TokenAddress

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
    "SequenceBatch",
    "SequenceExistsError",
    "SequenceNotFoundError",
    "TokenAddress",
]
