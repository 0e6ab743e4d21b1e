"""What the scheduler side tells the workers each step, and what the workers tell it back.

Both travel inside vLLM (pickled with the scheduler output, and with the model runner output): plain dataclasses
of ints, strings and NumPy arrays, no kvpool object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass(frozen=True)
class BlockCopy:
    """One request's whole-block copies between kvpool's pool and vLLM's KV cache, for every layer at once:
    ``pool_blocks[i]`` <-> ``vllm_blocks[i]``. A store may carry no blocks: it still answers ``finished_sending``."""

    req_id: str
    pool_blocks: tuple[int, ...]
    vllm_blocks: tuple[int, ...]


@dataclass
class KVPoolConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers. ``pool_id`` names the pool the scheduler's block ids belong to (its server
    process and shared-memory segment, or CUDA IPC handle digest): a worker attached to another pool (kvpool
    restarted since) copies nothing and reports the loads as failed."""

    pool_id: str = ""
    loads: list[BlockCopy] = field(default_factory=list)  # before the forward pass, after the stores: pool -> vLLM
    # Before the forward pass, first: vLLM -> pool, KV an earlier step computed (appended by this step's call).
    stores: list[BlockCopy] = field(default_factory=list)  # finished requests'
    saves: list[BlockCopy] = field(default_factory=list)  # running requests' prompt blocks
    # Every load's, and every store's and save's, (pool id, vLLM id) pairs as one int64 array [2, n] each
    # (``with_pairs``, on the scheduler side): what the worker copies, with no per-id Python there.
    load_pairs: np.ndarray | None = None
    store_pairs: np.ndarray | None = None

    def with_pairs(self) -> KVPoolConnectorMetadata:
        """The step's id arrays, built from ``loads``, ``stores`` and ``saves`` as they are now (call it last)."""
        self.load_pairs = pairs_of(self.loads)
        self.store_pairs = pairs_of([*self.stores, *self.saves])
        return self


def pairs_of(copies: Sequence[BlockCopy]) -> np.ndarray:
    """The copies' pairs, in order, as one int64 array [2, n]: row 0 the pool's ids, row 1 vLLM's. ``ValueError``
    when a copy pairs a different number of pool and vLLM blocks."""
    n = 0
    for copy in copies:
        if len(copy.pool_blocks) != len(copy.vllm_blocks):
            raise ValueError("a copy pairs a different number of pool and vLLM blocks")
        n += len(copy.pool_blocks)
    pairs = np.empty((2, n), dtype=np.int64)
    if n:
        pairs[0] = np.fromiter(chain.from_iterable(c.pool_blocks for c in copies), dtype=np.int64, count=n)
        pairs[1] = np.fromiter(chain.from_iterable(c.vllm_blocks for c in copies), dtype=np.int64, count=n)
    return pairs


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """The stores and saves a worker could not make, by request (their kvpool blocks hold no KV: never sealed)."""

    failed_stores: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPoolWorkerMetadata):
            return KVPoolWorkerMetadata(self.failed_stores | other.failed_stores)
        return self
