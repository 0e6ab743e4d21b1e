"""ShardedPool: the pool of a tensor-parallel group -- one block-id space, N pools split by KV heads.

The core plans in block ids once, whatever N is; this pool carries each plan out on every rank's shard::

                            one allocator, one block table (core/)
                                        |  plan: copies, zero_block_ids, slots
                 +----------------------+----------------------+
                 v                      v                      v
    rank 0: pool [blocks, L, 2, bs, H/N, D]   rank 1: ...   rank N-1: ...     (GpuPool or HostPool each)
            heads [0, H/N)                    [H/N, 2H/N)   [(N-1)H/N, H)

- ``copy_blocks`` / ``zero_blocks``: validated once (``KVPool``), then started on EVERY device before waiting for
  any, then every device is waited for. The shards of one device are one group (``shard_groups.py``): on the GPU
  the batch's ids are uploaded once and ONE kernel launch copies or clears in all of that device's shards, on the
  group's stream; devices overlap. So when the call returns every device has finished: a block the core frees
  afterwards is recycled only after all the work that used it is done, on every device.
- ``write_slots`` / ``read_slots``: the whole-token format ``[n, L, 2, H, D]`` of the full layout (WriteKV's and
  ReadKV's wire format), split by heads across the shards on the way in, joined on the way out (a replicated head
  is written to every rank that holds it and read from the first).
- ``rank_shards()``: what maps each rank's shard (its own shm segment or CUDA IPC handle, its heads).

The control path does not grow with N: one validation, no per-rank call or message; the device work is one
upload, one launch and one synchronisation a device (per shard only on the host backend: a NumPy copy a segment).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvpool.layout import KVLayout
from kvpool.tensor_parallel import rank_heads, shard_layout
from kvpool_server.device.pool import KVPool, PoolAttachInfo, RankShard
from kvpool_server.device.shard_groups import ShardGroup, device_groups


class ShardedPool(KVPool):
    """N pools (``shards``, rank order) of ``shard_layout(layout, N)``, each ``num_blocks`` blocks, behind one
    block-id space; ``layout`` is the full (unsplit) layout.

    Invariants (beyond KVPool's, which hold for the group as a whole):
    - Every shard has the same ``num_blocks``, the same backend and layout ``shard_layout(layout, N)``; shard ``r``
      holds heads ``rank_heads(H, N, r)`` of every block.
    - A replicated head holds the same bytes on every rank that has it (every write and copy goes to all of them).
    - An operation returns only when it has finished on every shard (their work overlaps in between).
    - ``groups`` partition the shards by device (``shard_groups.device_groups``): a batch is started on every
      group before any group is waited for.
    - The shards are this pool's alone: only it calls them (under its lock), and ``close()`` closes them all.
    """

    def __init__(self, layout: KVLayout, shards: Sequence[KVPool]) -> None:
        n = len(shards)
        if n < 2:
            raise ValueError(f"a sharded pool needs at least 2 shards, got {n}")
        super().__init__(layout, shards[0].num_blocks)
        expected = shard_layout(layout, n)
        for rank, shard in enumerate(shards):
            if shard.layout != expected or shard.num_blocks != self.num_blocks or shard.backend != shards[0].backend:
                raise ValueError(f"shard {rank} is {shard!r} of {shard.layout}; every shard must be {expected} with "
                                 f"{self.num_blocks} blocks on the {shards[0].backend} backend")
        self.shards = list(shards)
        self.tensor_parallel = n
        self.backend = shards[0].backend
        self.heads = [rank_heads(layout.num_kv_heads, n, rank) for rank in range(n)]
        # ranks read for a whole token: the first holder of each head (every rank unless heads are replicated)
        self._read_ranks = [r for r in range(n) if r == 0 or self.heads[r].start != self.heads[r - 1].start]
        self.pool_bytes = sum(shard.pool_bytes for shard in self.shards)
        self.groups: list[ShardGroup] = shard_groups(self.shards)

    def launch_per_shard(self, per_shard: bool = True) -> None:
        """Drive every shard on its own (one upload, launch and synchronisation a shard), or, with False, one group
        a device again (the default). For comparing the two (``benchmarks/tp_decode_step.py --per-shard``)."""
        with self._lock:
            self._check_open()
            groups = shard_groups(self.shards, per_device=not per_shard)
            for group in self.groups:
                group.close()
            self.groups = groups

    def shard(self, rank: int) -> KVPool:
        """Rank ``rank``'s pool (its ``blocks`` / ``layer_kv`` are that rank's heads)."""
        return self.shards[rank]

    def layer_kv(self, layer: int) -> tuple[Any, Any]:
        raise TypeError("a sharded pool has no single view of every head: use shard(rank).layer_kv(layer)")

    def attach_info(self) -> PoolAttachInfo:
        """Rank 0's (DescribePool's single fields, for clients that know no ranks)."""
        self._check_open()
        return self.shards[0].attach_info()

    def rank_shards(self) -> list[RankShard]:
        self._check_open()
        return [RankShard(rank, self.heads[rank], shard.layout, shard.attach_info())
                for rank, shard in enumerate(self.shards)]

    # --- backend hooks: every device's group, started before any is waited for ---------------------------------

    def _copy(self, pairs: np.ndarray) -> None:
        self._start_copy(pairs)
        self._wait()

    def _zero(self, ids: np.ndarray) -> None:
        self._start_zero(ids)
        self._wait()

    def _start_copy(self, pairs: np.ndarray) -> None:
        for group in self.groups:
            group.start_copy(pairs)

    def _start_zero(self, ids: np.ndarray) -> None:
        for group in self.groups:
            group.start_zero(ids)

    def _wait(self) -> None:
        for group in self.groups:
            group.wait()

    def _write(self, slots: np.ndarray, data: np.ndarray) -> None:
        for shard, heads in zip(self.shards, self.heads):
            shard._write(slots, np.ascontiguousarray(data[:, :, :, heads.start : heads.stop]))

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        for rank in self._read_ranks:
            shard, heads = self.shards[rank], self.heads[rank]
            part = np.empty((len(slots), *shard.layout.token_shape), dtype=shard.layout.storage_dtype)
            shard._read(slots, part)
            out[:, :, :, heads.start : heads.stop] = part

    def _release(self) -> None:
        for group in self.groups:
            group.close()
        for shard in self.shards:
            shard.close()


def shard_groups(shards: Sequence[KVPool], *, per_device: bool = True) -> list[ShardGroup]:
    """The groups ``shards`` are driven as: one a device (``per_device``; several GPU shards on a device become
    one ``GpuShardGroup``), or one a shard (the per-shard launches, kept to compare against)."""
    plan = device_groups(shards) if per_device else [[rank] for rank in range(len(shards))]
    groups: list[ShardGroup] = []
    try:
        for ranks in plan:
            members = [shards[rank] for rank in ranks]
            if len(members) > 1 and members[0].backend == "gpu":
                from kvpool_server.device.gpu_shard_group import GpuShardGroup

                groups.append(GpuShardGroup(members))
            else:
                groups.append(ShardGroup(members))
    except BaseException:
        for group in groups:
            group.close()
        raise
    return groups
