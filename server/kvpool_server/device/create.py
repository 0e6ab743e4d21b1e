"""create_pool: the pool of the backend asked for (the GPU when there is one, with "auto"), sized as asked -- one
pool, or with ``tensor_parallel`` N > 1 a ShardedPool of N pools split by KV heads. Kept apart from pool.py, which
the backends import: the factory imports them, never the other way."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from kvpool.layout import KVLayout
from kvpool.tensor_parallel import check_split, group_block_bytes, shard_layout
from kvpool_server.device import pool as base
from kvpool_server.device.pool import BACKENDS, KVPool, resolve_num_blocks

logger = logging.getLogger("kvpool_server.device")


def create_pool(
    layout: KVLayout,
    *,
    backend: str = "auto",
    pool_bytes: int | None = None,
    num_blocks: int | None = None,
    gpu_memory_fraction: float | None = None,
    tensor_parallel: int = 1,
    devices: Sequence[int] | None = None,
) -> KVPool:
    """Allocate the pool. ``backend="auto"`` takes the GPU when ``gpu_available()``, else host shared memory.

    Size: exactly one of ``num_blocks``, ``pool_bytes`` or ``gpu_memory_fraction`` -- a fraction of the free GPU
    memory (``cudaMemGetInfo``), or on the host backend of the free space of ``/dev/shm``.

    ``tensor_parallel`` N > 1: a ``ShardedPool`` of N pools of ``shard_layout(layout, N)``, the same ``num_blocks``
    each; ``pool_bytes`` is then the bytes of all N together (the same blocks as one pool of ``layout`` unless heads
    are replicated), ``gpu_memory_fraction`` a fraction of each device's free memory (the smallest decides).
    ``devices``: the CUDA device of each rank (GPU only; default: every shard on device 0, logged).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_split(layout.num_kv_heads, tensor_parallel)
    if devices is not None and len(devices) != tensor_parallel:
        raise ValueError(f"give one device per rank: {tensor_parallel} ranks, {len(devices)} devices")
    if backend == "auto":
        backend = "gpu" if base.gpu_available() else "host"
    if tensor_parallel > 1:
        return _create_sharded(layout, backend, pool_bytes, num_blocks, gpu_memory_fraction, tensor_parallel,
                               devices)
    if backend == "gpu":
        from kvpool_server.device.gpu_pool import GpuPool, free_gpu_bytes

        if devices:
            import cupy

            with cupy.cuda.Device(devices[0]):
                free = free_gpu_bytes() if gpu_memory_fraction is not None else None
                return GpuPool(layout, resolve_num_blocks(layout, free, pool_bytes, num_blocks, gpu_memory_fraction))
        free = free_gpu_bytes() if gpu_memory_fraction is not None else None
        return GpuPool(layout, resolve_num_blocks(layout, free, pool_bytes, num_blocks, gpu_memory_fraction))
    from kvpool_server.device.host_pool import HostPool

    free = _free_shm_bytes() if gpu_memory_fraction is not None else None
    return HostPool(layout, resolve_num_blocks(layout, free, pool_bytes, num_blocks, gpu_memory_fraction))


def _create_sharded(layout: KVLayout, backend: str, pool_bytes: int | None, num_blocks: int | None,
                    gpu_memory_fraction: float | None, n: int, devices: Sequence[int] | None) -> KVPool:
    from kvpool_server.device.sharded_pool import ShardedPool

    part = shard_layout(layout, n)
    shards: list[KVPool] = []
    try:
        if backend == "gpu":
            import cupy

            from kvpool_server.device.gpu_pool import GpuPool, free_gpu_bytes

            if devices is None:
                devices = [0] * n
                logger.info("tensor parallel %d: all %d shards on CUDA device 0 (no --tp-devices)", n, n)
            blocks = num_blocks
            if blocks is None and pool_bytes is not None:
                blocks = _blocks_for(pool_bytes, group_block_bytes(layout, n))
            if blocks is None:
                assert gpu_memory_fraction is not None
                fits = []
                for device in sorted(set(devices)):
                    with cupy.cuda.Device(device):
                        free = free_gpu_bytes()
                    fits.append(resolve_num_blocks(part, free, gpu_memory_fraction=gpu_memory_fraction)
                                // devices.count(device))
                blocks = min(fits)
            _check_blocks(blocks, layout)
            for device in devices:
                with cupy.cuda.Device(device):
                    shards.append(GpuPool(part, blocks))
        else:
            from kvpool_server.device.host_pool import HostPool

            if num_blocks is not None:
                blocks = num_blocks
            elif pool_bytes is not None:
                blocks = _blocks_for(pool_bytes, group_block_bytes(layout, n))
            else:
                assert gpu_memory_fraction is not None
                blocks = resolve_num_blocks(part, _free_shm_bytes(), gpu_memory_fraction=gpu_memory_fraction) // n
            _check_blocks(blocks, layout)
            for _ in range(n):
                shards.append(HostPool(part, blocks))
        return ShardedPool(layout, shards)
    except BaseException:
        for shard in shards:
            shard.close()
        raise


def _blocks_for(pool_bytes: int, block_bytes: int) -> int:
    return int(pool_bytes) // block_bytes


def _check_blocks(blocks: int, layout: KVLayout) -> None:
    if blocks < 1:
        raise ValueError(f"the pool must hold at least one block of {layout.block_bytes} bytes")


def _free_shm_bytes() -> int:
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize

