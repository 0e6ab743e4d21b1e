"""Map the server's pool into this process: POSIX shared memory by name (host backend) or a CUDA IPC handle (gpu).

Both give a ``MappedPool`` whose ``.flat`` is a 1-d array of **bytes** (uint8) over the whole pool -- NumPy for the
host backend, CuPy for the GPU. Bytes, because the mapping does not know the layout; view it with the layout::

    pool = map_host_pool(info.shm_name, info.pool_bytes)
    blocks = pool.blocks(layout)          # [num_blocks, L, 2, block_size, H, D], zero-copy
    ...
    pool.close()                          # unmaps; never unlinks or frees: the server owns the memory

CuPy is imported only by ``map_gpu_pool``: the client installs without it.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable

import numpy as np

from kvpool.layout import KVLayout, blocks_view
from kvpool.shm import open_shm


class MappedPool:
    """A mapping of another process's pool. Invariant: it never unlinks or frees the pool, only unmaps it.

    Arrays taken from ``flat`` must not be used after ``close()`` on the GPU (the IPC mapping is gone); on the
    host an array that is still alive keeps its pages mapped until it is garbage.
    """

    def __init__(self, flat: Any, pool_bytes: int, backend: str, release: Callable[[], None]) -> None:
        self.flat = flat
        self.pool_bytes = pool_bytes
        self.backend = backend
        self._release = release
        self._closed = False

    def blocks(self, layout: KVLayout) -> Any:
        """The 6-d blocks view ``[pool_bytes // block_bytes, L, 2, block_size, H, D]`` in the storage dtype."""
        if self._closed:
            raise RuntimeError("the mapping is closed")
        return blocks_view(self.flat.view(layout.storage_dtype), layout, layout.num_blocks_for(self.pool_bytes))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.flat = None
        self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> MappedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def map_host_pool(shm_name: str, pool_bytes: int) -> MappedPool:
    """Map the host backend's pool by its shared-memory name; ``.flat`` is a NumPy uint8 array."""
    mm = open_shm(shm_name, pool_bytes)
    flat = np.frombuffer(mm, dtype=np.uint8, count=pool_bytes)

    def release() -> None:
        try:
            mm.close()
        except BufferError:  # arrays taken from .flat are alive: the pages stay mapped until they are garbage
            pass

    return MappedPool(flat, pool_bytes, "host", release)


def map_gpu_pool(handle: bytes, pool_bytes: int, device: int) -> MappedPool:
    """Map the GPU backend's pool from its 64-byte CUDA IPC handle; ``.flat`` is a CuPy uint8 array on ``device``.

    Must run in a process other than the server (CUDA refuses to open a handle in the process that exported it).
    Close the mapping before the server frees the pool.
    """
    import cupy

    if len(handle) != 64:
        raise ValueError(f"a CUDA IPC handle is 64 bytes, got {len(handle)}")
    runtime = cupy.cuda.runtime
    with cupy.cuda.Device(device):
        ptr = runtime.ipcOpenMemHandle(bytes(handle), runtime.cudaIpcMemLazyEnablePeerAccess)
        mem = cupy.cuda.UnownedMemory(ptr, pool_bytes, None, device)
        flat = cupy.ndarray((pool_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))

    def release() -> None:
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()
            runtime.ipcCloseMemHandle(ptr)

    return MappedPool(flat, pool_bytes, "gpu", release)
