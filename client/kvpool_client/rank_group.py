"""RankGroup: every rank's shard of a tensor-parallel pool mapped into ONE process, read and written as whole tokens.

A real tensor-parallel frontend has one process a rank, each mapping its own shard (``client.attach(rank=r)``) and
writing its heads only. This is all of them at once -- what a test, the load generator or a single-process tool
needs to write and check whole tokens ``[n, L, 2, H, D]`` (the full layout) through the mappings::

    write_slots(slots, kv):  kv[..., heads of rank r, :]  ->  rank r's AttachedPool, for every r
    read_slots(slots):       rank r's heads              <-  the first rank holding them

A replicated head (more ranks than heads) is written to every rank that holds it. Host arrays on either backend;
on a GPU pool the data goes through each rank's pinned staging (device arrays: use each rank's AttachedPool).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool_client.attach import AttachedPool
from kvpool_client.errors import InvalidArgumentError
from kvpool_client.kernels.arrays import to_numpy
from kvpool_client.types import PoolDescription


class RankGroup:
    """The shards ``ranks`` (rank order) of the pool ``description``; ``close()`` unmaps them all."""

    def __init__(self, description: PoolDescription, ranks: Sequence[AttachedPool]) -> None:
        if len(ranks) != len(description.shards):
            raise ValueError(f"{len(description.shards)} ranks in the pool, {len(ranks)} attached")
        self.description = description
        self.layout = description.layout  # the full layout: whole tokens
        self.num_blocks = description.num_blocks
        self.backend = description.backend
        self.ranks = list(ranks)
        self.heads = [shard.heads for shard in description.shards]
        self._read_ranks = [r for r in range(len(ranks)) if r == 0 or self.heads[r] != self.heads[r - 1]]

    @property
    def closed(self) -> bool:
        return all(rank.closed for rank in self.ranks)

    def write_slots(self, slots: Any, data: Any, *, stream: Any = None) -> None:
        """Write whole tokens' KV ``data`` [n, L, 2, H, D] into ``slots``: each rank gets its heads. Host data, or on
        a GPU pool a CuPy array (each rank's heads copied out on the device; ranks on other devices need peer
        access to it), asynchronous on ``stream`` as ``AttachedPool.write_slots`` is."""
        on_device = hasattr(data, "__cuda_array_interface__")
        if not on_device:
            data = to_numpy(data)
        expected = (len(slots), *self.layout.token_shape)
        if tuple(data.shape) != expected:
            raise InvalidArgumentError(f"data must have shape {expected}, got {tuple(data.shape)}")
        xp: Any = _cupy() if on_device else np
        for rank, heads in zip(self.ranks, self.heads):
            rank.write_slots(slots, xp.ascontiguousarray(data[:, :, :, heads.start:heads.stop]), stream=stream)

    def read_slots(self, slots: Any, *, stream: Any = None) -> np.ndarray:
        """Whole tokens' KV at ``slots`` as a new host array [n, L, 2, H, D], joined from the ranks' heads."""
        out = np.empty((np.size(slots), *self.layout.token_shape), dtype=self.layout.storage_dtype)
        for r in self._read_ranks:
            heads = self.heads[r]
            out[:, :, :, heads.start:heads.stop] = to_numpy(self.ranks[r].read_slots(slots, stream=stream))
        return out

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cupy() -> Any:
    import cupy  # noqa: PLC0415  (lazy: the client installs without CuPy)

    return cupy
