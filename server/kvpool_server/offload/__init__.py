"""The host tier (``--host-tier-bytes``): sealed blocks the pool evicts, kept in host memory and brought back -- in
the shape of vLLM v1's kv_offload, a manager that plans and a worker that copies, with one driver between them.

    host_tier.py          HostTier, the manager: hash -> host slot, the host LRU, pins; prepare_store (a plan's
                          evicted blocks -> StorePlan), commit / abort; its invariants (-> events)
    restore.py            a register's load plan: stage (-> StagedRestore, with its own stores) / finish
    writeback.py          the pool's next evictable blocks copied ahead: plan / finish
    events.py             the tier's medium ("CPU") and its one-block BlockStored
    tier_pool.py          TierPool / HostTierPool, the worker: the tier's memory and copies, host backend
    gpu_tier_pool.py      GpuTierPool: pinned host memory, copied by the copy engines (cupy)
    sharded_tier_pool.py  ShardedTierPool: one tier per shard of a tensor-parallel pool, one slot-id space
    create.py             create_tier_pool: the tier of a pool of either backend, allocated in the background
    tier_copies.py        TierCopies, the driver: a mutation's stores after its core call and before its device work
                          (``append`` / ``call``), a register's loads with the lock free (``start_restore`` /
                          ``finish_restore``), the write-back thread
    stats.py, metrics.py  the tier's PoolStats fields beside the manager's (``with_tier``); its Prometheus families

Imports point down: ``service`` -> ``offload`` -> ``core``, ``device``; the core holds no tier (it names a call's
evictions in its plan: ``AppendPlan.evicted``). See docs/architecture.md.
"""
