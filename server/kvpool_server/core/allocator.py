"""BlockAllocator: the free list and reference counts of the pool's physical blocks."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.errors import (
    InvalidArgumentError,
    InvariantViolationError,
    OutOfBlocksError,
    QuotaExceededError,
)
from kvpool_server.core.eviction_policy import EvictionPolicy
from kvpool_server.core.prefix_cache import PrefixCache
from kvpool_server.core.types import UNLIMITED

# 0-d arrays of the ref counts' dtype: ``put`` of one of these costs less than of a Python int.
_ONE, _ZERO = np.array(1, dtype=np.int32), np.array(0, dtype=np.int32)


class BlockAllocator:
    """Hands out physical block ids from a free list and counts who references each block.

    The allocator never touches KV memory; it only decides which block ids are in use.

    The free list is a stack kept in a NumPy array (``_free_stack[:num_free_blocks]``, top at the end), not a deque:
    taking or returning k blocks is one slice, O(1) per block, with no Python loop, and the most recently freed
    block (still warm in cache) is reused first.

    Invariants (checked by ``check_invariants``):
      - ``num_free_blocks`` is in [0, num_blocks];
      - the padding entry ``ref_count_padded[num_blocks]`` (what an UNSET block-table entry looks up) stays 0;
      - ``num_shared_blocks`` is the number of blocks with a ref count above 1 (kept so that, while nothing is
        shared, appends skip the copy-on-write test and frees skip the duplicate handling);
      - ref counts are never negative;
      - the free list holds each free block exactly once, so a block id is never handed out twice;
      - a block is on the free list iff its ref count is 0 and it is not evictable (prefix caching: a cached
        block reaching ref count 0 keeps its content on ``cache``'s evictable LRU instead);
      - no block is both free and evictable; ``cache``'s own invariants hold.

    Allocation takes truly free blocks first, then evicts the least recently used cached blocks
    (``cache.evict``): free + evictable is what can be allocated (``num_allocatable``). While nothing is cached
    (``cache.num_cached == 0``) no path below does any extra work.

    ::

        _free_stack:  [ 7  3  9  4 | stale ... ]      ref_count:  block 4 -> 0 (free, on the stack)
                                  ^ num_free_blocks               block 5 -> 2 (shared by two sequences)
    """

    def __init__(self, num_blocks: int, eviction: EvictionPolicy | None = None) -> None:
        if num_blocks < 1:
            raise InvalidArgumentError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks: int = num_blocks
        # One extra slot that stays 0, so that looking up an UNSET (-1) block-table entry reads ref count 0.
        self.ref_count_padded: np.ndarray = np.zeros(num_blocks + 1, dtype=np.int32)
        self.ref_count: np.ndarray = self.ref_count_padded[:num_blocks]
        # Reversed so that block 0 is handed out first on a fresh pool.
        self._free_stack: np.ndarray = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self.num_free_blocks: int = num_blocks
        self.num_shared_blocks: int = 0
        self.cache: PrefixCache = PrefixCache(num_blocks, eviction)  # eviction: its policy (None: LRU)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some sequence references (neither free nor evictable)."""
        return self.num_blocks - self.num_free_blocks - self.cache.num_evictable

    @property
    def num_allocatable(self) -> int:
        return self.num_free_blocks + self.cache.num_evictable

    def allocate(self, num: int, budget: int = UNLIMITED, why: str = "") -> np.ndarray:
        """Take ``num`` free blocks, each with ref count 1, evicting cached ones when the free list runs dry. Raises
        OutOfBlocksError (changing nothing) if too few, QuotaExceededError if more than ``budget`` (a tenant's:
        ``TenantLedger.budget``, passed down with each append; ``why`` names the quota that bounds it)."""
        if num > self.num_free_blocks or num > budget:
            if num > budget or num > self.num_allocatable:
                raise self._refusal(num, budget, why)
            self._push(self.cache.evict(num - self.num_free_blocks))
        top = self.num_free_blocks
        block_ids = self._free_stack[top - num : top][::-1].copy()
        self.num_free_blocks = top - num
        self.ref_count.put(block_ids, _ONE)
        return block_ids

    def allocate_one(self, budget: int = UNLIMITED, why: str = "") -> int:
        """``allocate(1, budget, why)``, as an int."""
        if self.num_free_blocks == 0 or budget < 1:
            if budget < 1 or not self.cache.num_evictable:
                raise self._refusal(1, budget, why)
            self._push(self.cache.evict(1))
        self.num_free_blocks -= 1
        block_id = self._free_stack.item(self.num_free_blocks)
        self.ref_count[block_id] = 1
        return block_id

    def incref(self, block_ids: np.ndarray, times: int = 1) -> None:
        """Add ``times`` references to each of ``block_ids``: distinct blocks, each in use."""
        self.num_shared_blocks += int(np.count_nonzero(self.ref_count[block_ids] == 1))
        self.ref_count[block_ids] += times

    def reuse(self, block_ids: np.ndarray) -> int:
        """Take one more reference to each of the distinct cached ``block_ids`` (a prefix match), taking those of
        ref count 0 off the evictable LRU. Returns how many were revived (had ref count 0)."""
        idle = block_ids[self.ref_count[block_ids] == 0]
        self.cache.unpark(idle)
        self.incref(block_ids)
        return int(idle.size)

    def decref(self, block_ids: np.ndarray) -> int:
        """Drop one reference per entry of ``block_ids`` (ids may repeat); blocks reaching 0 go back on the free list.

        Returns how many blocks were freed.
        """
        if block_ids.size == 0:
            return 0
        if self.num_shared_blocks == 0:  # every block in use has exactly one reference: ids are distinct
            self.ref_count.put(block_ids, _ZERO)
            if self.cache.num_cached:
                self._retire_distinct(block_ids)
            else:
                self._push(block_ids)
            return int(block_ids.size)
        if block_ids.size * 8 >= self.num_blocks:
            # Many references (a free of a thousand forks of a long sequence: millions): count them per block in one
            # pass, O(size + num_blocks); sort-based unique and subtract.at cost ~100 ns an entry (~1 s for 8 M).
            counts = np.bincount(block_ids, minlength=self.num_blocks)
            touched = np.flatnonzero(counts)
            shared_before = np.count_nonzero(self.ref_count[touched] > 1)
            self.ref_count[touched] -= counts[touched].astype(self.ref_count.dtype)
        else:
            touched = np.unique(block_ids)
            shared_before = np.count_nonzero(self.ref_count[touched] > 1)
            np.subtract.at(self.ref_count, block_ids, 1)
        after = self.ref_count[touched]
        self.num_shared_blocks -= int(shared_before - np.count_nonzero(after > 1))
        freed = touched[after == 0]
        if self.cache.num_cached:
            self._retire(freed, block_ids)
        else:
            self._push(freed)
        return int(freed.size)

    def _retire(self, freed: np.ndarray, order: np.ndarray) -> None:
        """Blocks that reached ref count 0: uncached ones go on the free list, cached ones on the evictable LRU,
        in the reverse of their order in ``order`` (a sequence's tail first: leaves are evicted first)."""
        cached = self.cache.is_cached[freed]
        if not cached.any():
            self._push(freed)
            return
        self._push(freed[~cached])
        keep = np.zeros(self.num_blocks, dtype=bool)
        keep[freed[cached]] = True
        reverse = order[::-1]
        unique, first = np.unique(reverse, return_index=True)
        self.cache.park(reverse[np.sort(first[keep[unique]])])

    def _retire_distinct(self, freed: np.ndarray) -> None:
        """``_retire(freed, freed)`` for distinct ``freed`` (nothing was shared): each block's only position is its
        last, so the cached ones are parked in the reverse of ``freed`` without the search for last positions."""
        cached = self.cache.is_cached[freed]
        num_cached = np.count_nonzero(cached)
        if num_cached < freed.size:
            self._push(freed[~cached] if num_cached else freed)
        if num_cached:
            self.cache.park(freed[::-1][cached[::-1]] if num_cached < freed.size else freed[::-1])

    def _refusal(self, num: int, budget: int, why: str) -> OutOfBlocksError:
        if num > budget and num <= self.num_allocatable:
            return QuotaExceededError(f"need {num} blocks, over {why}")
        return OutOfBlocksError(
            f"need {num} free blocks, {self.num_free_blocks} of {self.num_blocks} are free"
            + (f" and {self.cache.num_evictable} evictable" if self.cache.num_evictable else "")
        )

    def _push(self, block_ids: np.ndarray) -> None:
        top = self.num_free_blocks
        self._free_stack[top : top + block_ids.size] = block_ids
        self.num_free_blocks = top + int(block_ids.size)

    def free_block_ids(self) -> np.ndarray:
        """A copy of the free list, top last."""
        return self._free_stack[: self.num_free_blocks].copy()

    def check_invariants(self) -> None:
        if not 0 <= self.num_free_blocks <= self.num_blocks:
            raise InvariantViolationError(f"num_free_blocks {self.num_free_blocks} outside [0, {self.num_blocks}]")
        if self.ref_count_padded[-1] != 0:
            raise InvariantViolationError("the padding ref count slot was written")
        if self.num_shared_blocks != np.count_nonzero(self.ref_count > 1):
            raise InvariantViolationError(
                f"num_shared_blocks={self.num_shared_blocks} but {np.count_nonzero(self.ref_count > 1)} blocks are shared"
            )
        if (self.ref_count < 0).any():
            raise InvariantViolationError(f"negative ref counts at blocks {np.flatnonzero(self.ref_count < 0)}")
        free = self._free_stack[: self.num_free_blocks]
        if np.unique(free).size != free.size:
            raise InvariantViolationError("a block is on the free list twice")
        on_free_list = np.zeros(self.num_blocks, dtype=bool)
        on_free_list[free] = True
        evictable = np.zeros(self.num_blocks, dtype=bool)
        evictable[list(self.cache.evictable)] = True
        if (on_free_list & evictable).any():
            raise InvariantViolationError(f"blocks {np.flatnonzero(on_free_list & evictable)[:8]} are free and evictable")
        zero_ref = (self.ref_count == 0) & ~evictable
        if not np.array_equal(on_free_list, zero_ref):
            bad = np.flatnonzero(on_free_list != zero_ref)
            raise InvariantViolationError(
                f"a block is on the free list iff its ref count is 0 and it is not evictable; broken at {bad[:8]}"
            )
        self.cache.check_invariants(self.ref_count)
