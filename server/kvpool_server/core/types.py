"""Results of the core: small immutable records (a NamedTuple, a frozen dataclass) and NumPy arrays, never protobuf
messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvpool_server.core.kv_event_types import CachedBlock


class EvictedBlocks(NamedTuple):
    """The cached blocks a call evicted, oldest first, with what each held (a keeper outside the core -- the host
    tier -- decides which to store before anyone writes into them, and which hashes are gone:
    ``PrefixCache.keep_evictions``)."""

    block_ids: list[int]
    entries: list[CachedBlock]


NO_EVICTIONS = EvictedBlocks([], [])


class AppendPlan(NamedTuple):
    """What an append did, for the device layer to execute and the caller to write to.

    A NamedTuple (immutable, like the frozen dataclasses below) because one is made per append, and a NamedTuple
    costs half a frozen dataclass to build.

    slot_mapping:  int64 [num_new_tokens], the physical slot (block_id * block_size + offset) of every new token,
                   grouped by sequence in request order.
    new_block_ids: int32 [k], blocks allocated by the append, copy-on-write destinations included.
    copies:        int32 [c, 2], (src_block_id, dst_block_id) copy-on-write pairs; the device layer must run
                   them (``pool.copy_blocks(plan.copies)``) before anyone writes into the new slots.
    zero_block_ids: int32 [z], the blocks of ``new_block_ids`` that are not copy-on-write destinations: taken from
                   the free list or evicted from the prefix cache, they still hold their last owner's KV, which the
                   new owner's unwritten slots would expose. The device layer clears them
                   (``pool.zero_blocks(plan.zero_block_ids)``) before the copies and the writes. A copy-on-write
                   destination is left out: its copy overwrites all of it. Blocks a ``register`` adopts from the
                   prefix cache are never cleared (their content is what is shared); they are in no plan. Empty
                   (a shared read-only constant, no allocation) on the steps that take no block, most decode steps.
    evicted:       the cached blocks the append evicted to find its new blocks, with their content (only when the
                   prefix cache keeps its evictions for a keeper: ``PrefixCache.keep_evictions``; else
                   ``NO_EVICTIONS``). Some are among ``new_block_ids``: a keeper stores them (``offload``) before the
                   device layer clears, copies or writes anything.
    """

    slot_mapping: np.ndarray
    new_block_ids: np.ndarray
    copies: np.ndarray
    zero_block_ids: np.ndarray
    evicted: EvictedBlocks = NO_EVICTIONS

    @property
    def num_new_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's occupancy.

    num_slots_unused counts token slots inside used blocks that hold no token, once per physical block (internal
    fragmentation). External fragmentation is 0 by construction: every free block is usable by any sequence.
    """

    num_blocks_total: int
    num_blocks_free: int
    num_blocks_used: int
    num_blocks_shared: int
    num_tokens: int
    num_slots_unused: int
    num_copies: int
    num_sequences: int
    block_size: int
    num_blocks_evictable: int = 0  # cached blocks nobody holds: allocatable (free + evictable), evicted LRU first
    prefix_query_tokens: int = 0  # prompt tokens registered with their ids since start
    prefix_hit_tokens: int = 0  # of those, tokens found cached (the frontend skips computing them)
    host_tier_blocks_total: int = 0  # the host tier's slots (0: no tier)
    host_tier_blocks_ready: int = 0  # of those, allocated (pinned) so far: the tier is allocated in the background
    host_tier_blocks_cached: int = 0  # of those, holding a matchable block
    prefix_host_hit_tokens: int = 0  # of the hit tokens, those restored from the host tier
    num_tokens_appended: int = 0  # slots handed out by appends since start
    num_blocks_evicted: int = 0  # cached blocks the prefix cache evicted since start (to allocate)
    host_tier_blocks_offloaded: int = 0  # blocks copied into the host tier and committed (write-backs included)
    host_tier_blocks_restored: int = 0  # blocks copied back into the pool
    host_tier_copy_failures: int = 0  # blocks of failed offloads and restores (dropped: a miss, never wrong KV)
    host_tier_blocks_used: int = 0  # ready slots holding a block (cached, or being written back)
    host_tier_blocks_written_back: int = 0  # of the offloaded blocks, those copied ahead by the write-back
    host_tier_offload_failures: int = 0  # of the copy failures, the offloads' (aborted)
    host_tier_blocks_fenced: int = 0  # of the copy failures, the restores' (their slots fenced: dropped)
    host_tier_blocks_torn: int = 0  # write-backs whose block was evicted during the copy (aborted, no failure)
    host_tier_blocks_dropped: int = 0  # cached slots the host LRU dropped to make room
    host_tier_evictions_unkept: int = 0  # evicted pool blocks the tier did not keep (not copied ahead, or no slot)

    @property
    def utilization(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def internal_fragmentation(self) -> float:
        used_slots = self.num_blocks_used * self.block_size
        return self.num_slots_unused / used_slots if used_slots else 0.0


UNLIMITED = 1 << 62  # the block budget of an append no quota bounds (``TenantLedger.budget``)
EMPTY_BLOCKS = np.zeros(0, dtype=np.int32)
EMPTY_BLOCKS.flags.writeable = False
NO_COPIES = np.zeros((0, 2), dtype=np.int32)
NO_COPIES.flags.writeable = False
