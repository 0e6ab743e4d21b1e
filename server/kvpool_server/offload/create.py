"""create_tier_pool: the host tier's memory for a pool of either backend (``tier_pool.py``), one tier per shard of
a tensor-parallel pool (``sharded_tier_pool.py``). Kept apart from the backends, which it imports."""

from __future__ import annotations

from collections.abc import Callable

from kvpool_server.device.pool import KVPool
from kvpool_server.offload.tier_pool import DEFAULT_CHUNK_BYTES, HostTierPool, TierPool


def create_tier_pool(pool: KVPool, num_slots: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                     on_ready: Callable[[int], None] = lambda n: None) -> TierPool:
    """The host tier of ``pool``'s backend (``tier_pool.py``), started (allocating in the background) and closed
    with the pool. A tensor-parallel pool gets one tier per shard behind one slot-id space
    (``sharded_tier_pool.py``)."""
    tier: TierPool
    if pool.tensor_parallel > 1:
        from kvpool_server.offload.sharded_tier_pool import ShardedTierPool

        tier = ShardedTierPool(pool, num_slots, _backend_tier, chunk_bytes, on_ready)
    else:
        tier = _backend_tier(pool, num_slots, chunk_bytes, on_ready)
    pool.tier = tier
    tier.start()
    return tier


def _backend_tier(pool: KVPool, num_slots: int, chunk_bytes: int, on_ready: Callable[[int], None]) -> TierPool:
    """The tier of one (unsharded) pool of either backend, not started."""
    if pool.backend == "gpu":
        from kvpool_server.offload.gpu_tier_pool import GpuTierPool

        return GpuTierPool(pool, num_slots, chunk_bytes, on_ready)
    return HostTierPool(pool, num_slots, chunk_bytes, on_ready)
