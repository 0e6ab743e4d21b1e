"""The host tier (``--host-tier-bytes``): sealed blocks the pool evicts, kept in host memory and brought back.

    tier_copies.py        TierCopies: the driver -- runs a mutation's stores after its core call and before its
                          device work (``call``), a register's restore with the lock free (``start_restore`` /
                          ``finish_restore``), the write-back thread (-> tier_pool)
    tier_pool.py          TierPool / HostTierPool: the tier's memory and its copies, host backend (-> device.pool)
    gpu_tier_pool.py      GpuTierPool: pinned host memory, copied by the copy engines (cupy)
    sharded_tier_pool.py  ShardedTierPool: one tier per shard of a tensor-parallel pool, one slot-id space
    create.py             create_tier_pool: the tier of a pool of either backend, allocated in the background
    metrics.py            tier_families: the tier's Prometheus families beyond its block gauges

Imports point down: ``service`` -> ``offload`` -> ``core``, ``device``. See docs/architecture.md.
"""
