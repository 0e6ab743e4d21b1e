"""Shard groups: the shards of a ShardedPool that share one device, whose block work goes out together.

A ShardedPool's ``copy_blocks`` / ``zero_blocks`` do not drive N shards; they drive one group a device::

    shards (rank order)    r0:d0  r1:d1  r2:d0  r3:d1          device_groups: [[0, 2], [1, 3]]
    groups                 d0: {r0, r2}    d1: {r1, r3}         every group started, then every group waited for

- GPU (``gpu_shard_group.GpuShardGroup``): a group of several shards on one device uploads a batch's ids once and
  clears or copies in all of them with ONE kernel launch (grid ``y``: the shard), then synchronises once -- the
  host's work for a batch grows with the number of devices, not of shards.
- Host (``ShardGroup``, and a GPU shard alone on its device): the shards' own ``_start_copy`` / ``_start_zero``
  one after another, then their ``_wait`` -- each HostPool is its own shared-memory segment, a NumPy copy each.

The planning (which shards go together) is this module's, for every backend; ``sharded_pool.shard_groups`` makes
the groups (importing the GPU's only for GPU shards) and the ShardedPool starts every group before it waits for any.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool_server.device.pool import KVPool


def device_groups(shards: Sequence[KVPool]) -> list[list[int]]:
    """The ranks of ``shards`` by the device that holds them (a GPU shard's ``device_id``; host shards are all in
    one group): groups in the order of their first rank, ranks ascending within a group."""
    groups: dict[object, list[int]] = {}
    for rank, shard in enumerate(shards):
        groups.setdefault(getattr(shard, "device_id", None), []).append(rank)
    return list(groups.values())


class ShardGroup:
    """Shards on one device, driven one after another: each shard's work started (``start_*``), then each waited
    for (``wait``). The GPU's group overrides the three with one launch for all its shards.

    Invariant: after ``wait`` returns, the work of every ``start_*`` before it has finished on every shard of
    the group (the device too)."""

    def __init__(self, shards: Sequence[KVPool]) -> None:
        if not shards:
            raise ValueError("a shard group needs at least one shard")
        self.shards = list(shards)

    def start_copy(self, pairs: np.ndarray) -> None:
        for shard in self.shards:
            shard._start_copy(pairs)

    def start_zero(self, ids: np.ndarray) -> None:
        for shard in self.shards:
            shard._start_zero(ids)

    def wait(self) -> None:
        for shard in self.shards:
            shard._wait()

    def close(self) -> None:
        """Release what the group holds of its own (not the shards: the ShardedPool closes them)."""
