"""GpuShardGroup: the GPU shards of a ShardedPool on one device, a batch's copies or clearing in ONE launch for all.

The shards of one device have the same layout and ``num_blocks`` (a ShardedPool's invariant), hence the same block
strides: only their base pointers differ. So the copy and zero kernels take an array of bases and ``gridDim.y`` =
the number of shards (``copy_kernel.py``, ``zero_kernel.py``); per batch, whatever the number of shards::

    pinned ids  --one cudaMemcpyAsync-->  device ids  --one launch, grid (items, k)-->  k shards  --one sync-->

    stream      one non-blocking stream of the group's own (the shards keep theirs, for token reads and writes)
    bases       device uint64 [k]          the shards' base pointers, uploaded once here (a pool never moves)
    pairs       device int32 [2 * num_blocks] + pinned twin    copy pairs (at most num_blocks destinations)
    zero_ids    device int32 [num_blocks] + pinned twin        a zero batch (longer: pieces, as GpuPool)
    kernels     the first shard's BlockCopier / BlockZeroer (compiled for this very block shape)

One ascending run of ids is cleared by cudaMemsetAsync instead when ``spans a block * k`` memsets stay within
``MEMSET_SPANS_MAX`` (``gpu_pool.zeroes_by_memset``), as a single pool does.

Ordering: a group's work runs on its own stream, which no shard's stream waits for; this is safe because every
pool operation has finished on the device when it returns (``wait`` synchronises the stream) and operations are
serialised by the ShardedPool's lock, so a shard's stream never has work in flight at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence

import cupy
import numpy as np

from kvpool_server.device.gpu_pool import GpuPool, raw_array, zeroes_by_memset
from kvpool_server.device.pool import KVPool
from kvpool_server.device.shard_groups import ShardGroup

_H2D = 1  # cudaMemcpyHostToDevice


class GpuShardGroup(ShardGroup):
    """``k`` GpuPools on one device driven as one: ``start_copy`` / ``start_zero`` upload the ids once and launch
    once for all ``k`` shards on the group's stream; ``wait`` synchronises it once.

    Invariants:
    - Every shard is a GpuPool on ``device_id`` with the first shard's layout and ``num_blocks``.
    - ``_bases[i]`` is shard ``i``'s base pointer, for the group's whole life.
    - The pinned ids buffers are rewritten only after ``wait`` (the ShardedPool waits before its call returns; a
      zero batch longer than ``num_blocks`` synchronises between its pieces).
    """

    def __init__(self, shards: Sequence[KVPool]) -> None:
        super().__init__(shards)
        pools: list[GpuPool] = []
        for shard in shards:
            if not isinstance(shard, GpuPool):
                raise TypeError(f"a GPU shard group holds GpuPools, got {shard!r}")
            pools.append(shard)
        lead = pools[0]
        for pool in pools:
            if pool.device_id != lead.device_id or pool.layout != lead.layout or pool.num_blocks != lead.num_blocks:
                raise ValueError(f"{pool!r} on device {pool.device_id} does not match {lead!r} on device "
                                 f"{lead.device_id}: a group's shards share a device, a layout and num_blocks")
        self.device = lead.device
        self.device_id = lead.device_id
        self.num_blocks = lead.num_blocks
        self.num_shards = len(pools)
        self.copier, self.zeroer = lead.copier, lead.zeroer
        self._base_ptrs = [pool.base_ptr for pool in pools]
        with self.device:
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._bases = raw_array(self.num_shards, np.uint64)
            self._bases.set(np.asarray(self._base_ptrs, dtype=np.uint64))  # on the current (default) stream:
            self.device.synchronize()  # done before the group's non-blocking stream reads it
            self._pairs = raw_array(2 * self.num_blocks, np.int32)
            self._pairs_pinned = cupy.cuda.alloc_pinned_memory(self._pairs.nbytes)
            self._zero_ids = raw_array(self.num_blocks, np.int32)
            self._zero_ids_pinned = cupy.cuda.alloc_pinned_memory(self._zero_ids.nbytes)
        self._pairs_host = np.frombuffer(self._pairs_pinned, dtype=np.int32, count=2 * self.num_blocks)
        self._zero_ids_host = np.frombuffer(self._zero_ids_pinned, dtype=np.int32, count=self.num_blocks)

    def start_copy(self, pairs: np.ndarray) -> None:
        """Enqueue the copies in every shard: one upload of the pairs, one launch (``wait`` waits for it)."""
        c = len(pairs)
        self._pairs_host[: 2 * c] = pairs.reshape(-1)
        with self.device:
            cupy.cuda.runtime.memcpyAsync(self._pairs.data.ptr, self._pairs_pinned.ptr, 8 * c, _H2D,
                                          self._stream.ptr)
            self.copier.launch(0, self._pairs.data.ptr, c, self._stream, shard_bases_ptr=self._bases.data.ptr,
                               num_shards=self.num_shards)

    def start_zero(self, ids: np.ndarray) -> None:
        """Enqueue the clearing in every shard: a few memsets for one run of ids, else one upload and one launch
        a piece of ``num_blocks`` ids (a longer batch repeats ids: the stream synchronised between pieces)."""
        with self.device:
            if self.zeroes_by_memset(ids):
                z = self.zeroer
                for base in self._base_ptrs:
                    first = base + int(ids[0]) * z.block_stride
                    for span in range(z.spans_per_block):
                        cupy.cuda.runtime.memsetAsync(first + span * z.seg_stride, 0, len(ids) * z.span_bytes,
                                                      self._stream.ptr)
                return
            for start in range(0, len(ids), self.num_blocks):
                if start:
                    self._stream.synchronize()  # the previous piece still reads the pinned ids buffer
                piece = ids[start : start + self.num_blocks]
                n = len(piece)
                self._zero_ids_host[:n] = piece
                cupy.cuda.runtime.memcpyAsync(self._zero_ids.data.ptr, self._zero_ids_pinned.ptr, 4 * n, _H2D,
                                              self._stream.ptr)
                self.zeroer.launch(0, self._zero_ids.data.ptr, n, self._stream,
                                   shard_bases_ptr=self._bases.data.ptr, num_shards=self.num_shards)

    def zeroes_by_memset(self, ids: np.ndarray) -> bool:
        """Whether ``start_zero(ids)`` takes memsets (one run; ``spans * k`` of them at most MEMSET_SPANS_MAX)."""
        return zeroes_by_memset(ids, self.zeroer.spans_per_block * self.num_shards)

    def wait(self) -> None:
        with self.device:
            self._stream.synchronize()  # also makes the pinned pairs / ids buffers reusable

    def close(self) -> None:
        if self._bases is None:
            return
        with self.device:
            self._stream.synchronize()
        self._bases = self._pairs = self._zero_ids = None
        self._pairs_host = self._pairs_pinned = self._zero_ids_host = self._zero_ids_pinned = None
