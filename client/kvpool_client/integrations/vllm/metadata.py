"""What the scheduler side tells the workers each step, and what the workers tell it back.

Both travel inside vLLM (pickled with the scheduler output, and with the model runner output): plain dataclasses
of ints and strings, no kvpool object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass
class KVPoolWorkerMetadata(KVConnectorWorkerMetadata):
    """The stores and saves a worker could not make, by request (their kvpool blocks hold no KV: never sealed)."""

    failed_stores: set[str] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVPoolWorkerMetadata):
            return KVPoolWorkerMetadata(self.failed_stores | other.failed_stores)
        return self
