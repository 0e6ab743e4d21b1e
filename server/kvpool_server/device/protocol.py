"""Pool: what the servicer and main use of a KV pool -- the type they hold it as, instead of ``Any``.

``device.KVPool`` (GpuPool, HostPool) satisfies it; so may a test double. Read-only members are properties here,
so plain attributes satisfy them.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from kvpool.layout import KVLayout
from kvpool_server.device import PoolAttachInfo
from kvpool_server.device.pool import RankShard


@runtime_checkable
class Pool(Protocol):
    @property
    def backend(self) -> str:
        """``"gpu"`` or ``"host"``."""

    @property
    def layout(self) -> KVLayout: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def tensor_parallel(self) -> int:
        """Ranks whose KV heads the pool holds apart (a ShardedPool); 1: one pool."""

    def copy_blocks(self, copies: Any) -> int:
        """Run copy-on-write pairs ``int[c, 2]`` (src, dst) as one batch, finished when it returns."""

    def zero_blocks(self, block_ids: Any) -> None:
        """Set every byte of blocks ``int[n]`` to zero (all layers, K and V), finished when it returns; an empty
        array returns at once."""

    def write_slots(self, slots: Any, data: Any) -> None:
        """Write token KV ``[n, L, 2, H, D]`` (the layout's storage dtype) into ``slots`` ``int[n]``."""

    def read_slots(self, slots: Any) -> np.ndarray:
        """Token KV at ``slots``, a new host array ``[n, L, 2, H, D]``."""

    def attach_info(self) -> PoolAttachInfo:
        """What another process needs to map the pool (rank 0's shard of a sharded pool)."""

    def rank_shards(self) -> list[RankShard]:
        """Each rank's heads, layout and what maps its shard, in rank order."""

    def close(self) -> None:
        """Release the memory; idempotent."""
