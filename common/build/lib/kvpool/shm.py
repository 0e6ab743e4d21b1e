"""Open the host backend's POSIX shared-memory pool by name: what the server (which creates it) and clients (which
map it) share."""

from __future__ import annotations

import mmap
import os


def open_shm(shm_name: str, pool_bytes: int) -> mmap.mmap:
    """Map an existing POSIX shared-memory segment read-write, with no resource_tracker involvement.

    ``multiprocessing.shared_memory.SharedMemory(name)`` would register the segment with this process's
    resource_tracker, which unlinks it when this process exits (Python < 3.13) -- deleting the server's pool.
    So this opens it at the OS level: ``shm_open`` + ``mmap``, nothing tracked.
    """
    try:
        import _posixshmem  # CPython's shm_open, what SharedMemory itself uses

        fd = _posixshmem.shm_open("/" + shm_name.lstrip("/"), os.O_RDWR, mode=0o600)
    except ImportError:  # pragma: no cover - CPython on POSIX always has it
        fd = os.open(os.path.join("/dev/shm", shm_name.lstrip("/")), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size < pool_bytes:
            raise ValueError(f"shared memory {shm_name!r} holds {size} bytes, fewer than pool_bytes={pool_bytes}")
        return mmap.mmap(fd, pool_bytes)
    finally:
        os.close(fd)
