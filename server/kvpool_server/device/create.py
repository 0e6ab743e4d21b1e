"""create_pool: the pool of the backend asked for (the GPU when there is one, with "auto"), sized as asked. Kept
apart from pool.py, which the backends import: the factory imports them, never the other way."""

from __future__ import annotations

import os
from collections.abc import Callable

from kvpool.layout import KVLayout
from kvpool_server.device import pool as base
from kvpool_server.device.pool import BACKENDS, KVPool, resolve_num_blocks
from kvpool_server.device.tier_pool import DEFAULT_CHUNK_BYTES, HostTierPool, TierPool


def create_pool(
    layout: KVLayout,
    *,
    backend: str = "auto",
    pool_bytes: int | None = None,
    num_blocks: int | None = None,
    gpu_memory_fraction: float | None = None,
) -> KVPool:
    """Allocate the pool. ``backend="auto"`` takes the GPU when ``gpu_available()``, else host shared memory.

    Size: exactly one of ``num_blocks``, ``pool_bytes`` or ``gpu_memory_fraction`` -- a fraction of the free GPU
    memory (``cudaMemGetInfo``), or on the host backend of the free space of ``/dev/shm``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "gpu" if base.gpu_available() else "host"
    if backend == "gpu":
        from kvpool_server.device.gpu_pool import GpuPool, free_gpu_bytes

        free = free_gpu_bytes() if gpu_memory_fraction is not None else None
        return GpuPool(layout, resolve_num_blocks(layout, free, pool_bytes, num_blocks, gpu_memory_fraction))
    from kvpool_server.device.host_pool import HostPool

    free = _free_shm_bytes() if gpu_memory_fraction is not None else None
    return HostPool(layout, resolve_num_blocks(layout, free, pool_bytes, num_blocks, gpu_memory_fraction))


def _free_shm_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize


def create_tier_pool(pool: KVPool, num_slots: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     on_ready: Callable[[int], None] = lambda n: None) -> TierPool:
    """The host tier of ``pool``'s backend (``tier_pool.py``), started (allocating in the background) and closed
    with the pool."""
    tier: TierPool
    if pool.backend == "gpu":
        from kvpool_server.device.gpu_tier_pool import GpuTierPool

        tier = GpuTierPool(pool, num_slots, chunk_bytes, on_ready)
    else:
        tier = HostTierPool(pool, num_slots, chunk_bytes, on_ready)
    pool.tier = tier
    tier.start()
    return tier
