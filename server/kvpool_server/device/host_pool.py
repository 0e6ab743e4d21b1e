"""HostPool: the pool in POSIX shared memory, for machines without a GPU.

Other processes map it by name (the client library's ``map_host_pool``), the way CUDA IPC maps the GPU pool.

Every page of the segment is reserved when the pool is made (``shm_segments.create_segment``: ``posix_fallocate``),
so a /dev/shm without the room fails the start with a message, never a later write with SIGBUS.

No segment outlives its server for long, whatever kills it. A clean exit unlinks it (``close()``); a plain crash
leaves it to the resource_tracker process, which unlinks it when the server dies. When the whole process group
dies at once (OOM killer, cgroup kill, ``kill -9 -PGID``) the tracker dies too and the name stays; so the name
says who owns it -- ``kvpool-<pid>-<start time>-<pid namespace>-<random>`` -- and every server, at start, unlinks
each kvpool segment whose owner is gone (``shm_segments.reap_stale_segments``). See docs/device.md for why not an
unnamed segment.
"""

from __future__ import annotations

import numpy as np

from kvpool.layout import KVLayout, blocks_view, gather_tokens, scatter_tokens, segments_view
from kvpool_server.device.pool import KVPool, PoolAttachInfo
from kvpool_server.settings import format_bytes
from kvpool_server.shm_segments import create_segment, segment_name, unlink_segment

RUN_SLICES_MAX = 8  # zero_blocks: up to this many runs as slices (one memset each), else one fancy assignment


def block_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive block ids, as ``[start, end)`` pairs of int64 arrays, sorted; repeats are dropped."""
    ids = np.unique(ids)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    ends = ids[np.concatenate((breaks - 1, [len(ids) - 1]))] + 1
    return starts.astype(np.int64), ends.astype(np.int64)


class HostPool(KVPool):
    """A shared-memory segment named ``kvpool-<pid>-<start time>-<pid namespace>-<random>``, owned by this object.

    Ownership: this process creates the segment (registered with its resource_tracker, so it is unlinked even if
    the process dies; every page reserved) and is the only one that unlinks it, in ``close()``. The pool's own
    mapping is a plain ``mmap`` of the segment, as in any other process, so arrays still alive after ``close()``
    stay valid (the pages are freed when the last of them is gone) instead of dangling.
    """

    backend = "host"

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        super().__init__(layout, num_blocks)
        self.shm_name = segment_name()
        # Registered with the resource_tracker (unlinked even if the process dies); every page reserved.
        self._mmap = create_segment(self.shm_name, self.pool_bytes, tracked=True,
                                    what=f"the pool ({format_bytes(self.pool_bytes)})")
        flat = np.frombuffer(self._mmap, dtype=layout.storage_dtype)
        self.blocks = blocks_view(flat, layout, self.num_blocks)
        # [num_blocks, 2L, segment_bytes]: a block's bytes whatever the order (strided for layer-major)
        self._segments = segments_view(np.frombuffer(self._mmap, dtype=np.uint8), layout, self.num_blocks)

    @property
    def segments(self) -> np.ndarray:
        """The pool's bytes as [num_blocks, 2L, segment_bytes] (the host tier copies through it)."""
        self._check_open()
        return self._segments

    def attach_info(self) -> PoolAttachInfo:
        self._check_open()
        return PoolAttachInfo(backend="host", pool_bytes=self.pool_bytes, shm_name=self.shm_name)

    def _copy(self, pairs: np.ndarray) -> None:
        # Safe as one gather/scatter because no destination is a source of the batch (KVPool's invariant).
        self._segments[pairs[:, 1]] = self._segments[pairs[:, 0]]

    def _zero(self, ids: np.ndarray) -> None:
        # Many ids: one fancy-indexed assignment, whose loop is in C (finding runs first -- a sort -- cost 3x the
        # assignment at 256 scattered blocks). A few ids: one slice per run (a memset per run; 2L strided ones
        # layer-major).
        if ids.size > RUN_SLICES_MAX:
            self._segments[ids] = 0
            return
        starts, ends = block_runs(ids)
        if len(starts) > RUN_SLICES_MAX:
            self._segments[ids] = 0
            return
        for start, end in zip(starts.tolist(), ends.tolist()):
            self._segments[start:end] = 0

    def _write(self, slots: np.ndarray, data: np.ndarray) -> None:
        scatter_tokens(self.blocks, slots, self.layout.block_size, data)

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        out[...] = gather_tokens(self.blocks, slots, self.layout.block_size)

    def _release(self) -> None:
        self._segments = None
        unlink_segment(self.shm_name, tracked=True)  # the name goes now; the memory with the last mapping
        try:
            self._mmap.close()
        except BufferError:  # caller still holds arrays of the pool: they keep the pages until they are garbage
            pass
