"""HostPool: the pool in POSIX shared memory, for machines without a GPU.

Other processes map it by name (the client library's ``map_host_pool``), the way CUDA IPC maps the GPU pool.
"""

from __future__ import annotations

import os
import secrets
from multiprocessing import shared_memory

import numpy as np

from kvpool.layout import KVLayout, blocks_view, gather_tokens, scatter_tokens, segments_view
from kvpool.shm import open_shm
from kvpool_server.device.pool import KVPool, PoolAttachInfo


class HostPool(KVPool):
    """A shared-memory segment named ``kvpool-<pid>-<random>``, owned by this object.

    Ownership: this process creates the segment (registered with its resource_tracker, so it is unlinked even if
    the process dies) and is the only one that unlinks it, in ``close()``. The pool's own mapping is a plain
    ``mmap`` of the segment, as in any other process, so arrays still alive after ``close()`` stay valid (the
    pages are freed when the last of them is gone) instead of dangling.
    """

    backend = "host"

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        super().__init__(layout, num_blocks)
        self.shm_name = f"kvpool-{os.getpid()}-{secrets.token_hex(6)}"
        # SharedMemory creates the segment and registers it for unlink-at-exit; we map it ourselves.
        owner = shared_memory.SharedMemory(name=self.shm_name, create=True, size=self.pool_bytes)
        self._segment = owner
        try:
            owner.close()  # drop SharedMemory's own mapping; the segment and its tracker registration stay
            self._mmap = open_shm(self.shm_name, self.pool_bytes)
        except BaseException:
            owner.unlink()
            raise
        flat = np.frombuffer(self._mmap, dtype=layout.storage_dtype)
        self.blocks = blocks_view(flat, layout, self.num_blocks)
        # [num_blocks, 2L, segment_bytes]: a block's bytes whatever the order (strided for layer-major)
        self._segments = segments_view(np.frombuffer(self._mmap, dtype=np.uint8), layout, self.num_blocks)

    def attach_info(self) -> PoolAttachInfo:
        self._check_open()
        return PoolAttachInfo(backend="host", pool_bytes=self.pool_bytes, shm_name=self.shm_name)

    def _copy(self, pairs: np.ndarray) -> None:
        # Safe as one gather/scatter because no destination is a source of the batch (KVPool's invariant).
        self._segments[pairs[:, 1]] = self._segments[pairs[:, 0]]

    def _write(self, slots: np.ndarray, data: np.ndarray) -> None:
        scatter_tokens(self.blocks, slots, self.layout.block_size, data)

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        out[...] = gather_tokens(self.blocks, slots, self.layout.block_size)

    def _release(self) -> None:
        self._segments = None
        try:
            self._segment.unlink()  # the name goes now; the memory when the last mapping (here or elsewhere) goes
        except FileNotFoundError:
            pass
        try:
            self._mmap.close()
        except BufferError:  # caller still holds arrays of the pool: they keep the pages until they are garbage
            pass
