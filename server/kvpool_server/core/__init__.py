"""The core: pure Python and NumPy. It imports neither grpc nor cupy.

Layering by floor: a module calls only modules on floors below its own (and reads the records of types.py,
errors.py and kv_event_types.py, the ground floor). No function takes the manager to call its private methods:
the floors below take plain arguments (rows, counts, a budget, arrays) and return plain results. The host tier is
not here (``kvpool_server.offload``, above the core): the core names what it evicted in its plans::

    7  manager.py          KVCacheManager: ids -> rows, validation; register (one, or a burst: register_many) /
                           append / fork / free, lookups. Append
                           is one pipeline: resolve ids and counts, plan within the tenant's budget (an argument),
                           then extend the token chains when tracked. Calls every floor below.
       checks.py           check_invariants(manager), stats(manager): read-only, over the manager's public state
       listings.py         sequence_infos(manager), session_usage(manager): read-only, as checks.py
    6  prefix_reuse.py     PrefixReuse: a register's cached run, the prompt's hashes, the hit counters
                           (-> token_chains, tenants)
       tenant_blocks.py    an append planned within its tenant's budget; rows released, each tenant credited
                           (-> tenants, block_tables)
       new_sequences.py    a register's prompt checked; a burst of registers refused where N single registers
                           would refuse one, before any is applied (-> call_args, tenants, block_tables)
    5  call_args.py        the calls' plain arguments checked (counts, token ids, register's prompt), pure functions
       session_members.py  SessionMembers: which live sequences each session holds (checked against seq_index)
       tenant_ids.py       TenantIds: with tenancy on, each tenant's own id namespace -> row (-> seq_index)
       tenants.py          TenantLedger: tenant of each row, blocks held, quotas -> budgets, public-block references
       token_chains.py     TokenChains: tracked rows' token ids and hashes; sealing (-> prefix_cache.insert)
       chain.py            Chain: one tracked row's hashes, sealed and pending (read by token_chains)
       filled_blocks.py    FilledBatch: a decode step's filled blocks hashed at once, their seal's columns (read by
                           token_chains)
       kv_events.py        KVEventLog: the cache's pending events -> numbered batches, bounded in bytes
                           (-> event_records: buffered packed)
    4  seq_index.py        SequenceIndex: seq_id -> row, scalar and vectorised
       block_tables.py     BlockTables: one page table row per sequence; plans appends (copy-on-write included),
                           taking blocks within the budget it is passed (-> allocator)
       length_lookups.py   LengthLookups: per-length arrays the planners gather through (read by block_tables)
       prompt_hashes.py    PromptHashes: a register's hashes of the prompt blocks past its cached run, kept for the
                           prefill (read by token_chains)
    3  allocator.py        BlockAllocator: free list and reference counts; evicts (-> prefix_cache)
    2  prefix_cache.py     PrefixCache: hash -> sealed block, the evictable set (its policy names the victims:
                           -> eviction_policy); records events into a pending list; with a keeper (the host
                           tier, ``offload/``), records each call's evictions for its plan
    1  eviction_policy.py  EvictionPolicy: which evictable block goes first; LruEviction, make_eviction_policy by name
                           (-> lrfu_eviction)
       lrfu_eviction.py    LrfuEviction: decayed reuse counts, rank buckets, a bounded ghost of evicted counts
       block_hash.py       chain hashes of token blocks (sha256; defined in common/kvpool/block_hash.py)
       block_records.py    BlockRecords: block id -> CachedBlock, held where the garbage collector never walks
       cached_records.py   CachedRecords: the prefix cache's, its token ids one [num_blocks, block_size] array
       event_records.py    an event batch packed into plain tuples (nothing for the collector to walk) and back
    0  types.py            AppendPlan (EvictedBlocks), PoolStats, UNLIMITED (results, immutable)
       pool_figures.py     POOL_FIGURES: each pool figure declared once (PoolStats / proto / client name, metric)
       kv_event_types.py   CachedBlock, BlockStored, BlockRemoved, AllBlocksCleared, EventBatch (records)
       errors.py           the exception tree
"""

from kvpool_server.core.allocator import BlockAllocator
from kvpool_server.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolationError,
    KVPoolError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
)
from kvpool_server.core.manager import KVCacheManager
from kvpool_server.core.types import AppendPlan, PoolStats

__all__ = [
    "AppendPlan",
    "BlockAllocator",
    "FailedPreconditionError",
    "InvalidArgumentError",
    "InvariantViolationError",
    "KVCacheManager",
    "KVPoolError",
    "OutOfBlocksError",
    "PoolStats",
    "SequenceExistsError",
    "SequenceNotFoundError",
]
