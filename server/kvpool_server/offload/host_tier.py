"""HostTier: the second tier of the prefix cache -- sealed blocks evicted from the pool, kept in host memory.

Pure bookkeeping, as ``PrefixCache`` is: it names host slots (block-sized rows of the host tier's memory,
``tier_pool.HostTierPool``) and never touches memory; it plans the copies (``StorePlan``, ``restore.StagedRestore``)
and the driver (``tier_copies.TierCopies``) runs them and reports back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import islice
from typing import NamedTuple

import numpy as np

from kvpool_server.core import KVCacheManager
from kvpool_server.core.block_records import BlockRecords
from kvpool_server.core.errors import InvalidArgumentError
from kvpool_server.core.kv_event_types import BlockRemoved, BlockStored
from kvpool_server.core.types import EvictedBlocks
from kvpool_server.offload.events import HOST_MEDIUM, host_stored, host_stored_runs
from kvpool_server.offload.host_tier_checks import check_host_tier
from kvpool_server.offload.scan_mark import MarkWatch

NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
NO_PAIRS.flags.writeable = False


class StorePlan(NamedTuple):
    """The stores a call's evictions need (``HostTier.prepare_store``), to run before anything writes into the
    evicted blocks: ``pairs`` int32 ``[n, 2]`` (pool block, host slot), each slot pending until ``commit`` (the
    copy completed) or ``abort``; ``wait``: first wait for the write-backs in flight (one of them reads an evicted
    block)."""

    pairs: np.ndarray
    wait: bool = False


NO_STORES = StorePlan(NO_PAIRS)


class HostTier:
    """Host slots holding sealed blocks the pool evicted: hash -> slot, and their own LRU.

    The pool's prefix cache keeps its evictions for the tier (``PrefixCache.keep_evictions``): an append's plan
    names the blocks it evicted (``AppendPlan.evicted``) and ``prepare_store`` plans them: each whose hash no slot
    holds yet gets a slot (a free one, else the host LRU's oldest is dropped) and a store ``(pool block, host slot)``
    in the returned ``StorePlan``. The driver copies the blocks out *before* anyone writes into the evicted blocks
    (their new owners' clearing included), then calls ``commit`` (the copy completed: the slot is matchable) or
    ``abort`` (it failed: the slot is free again, the content lost). A slot is matchable only once committed: no
    request is ever served from a slot whose bytes are not all there.

    Write-back (``writeback.plan`` / ``finish``, from the driver's background thread): the pool's evictable
    blocks next in line are copied ahead (``inflight``), and committed when the copy completed. A block being
    written back stays evictable: if an allocation evicts it, ``prepare_store`` says ``wait`` and the driver waits
    for that copy before anything writes into the block.

    Offload on eviction (``offload_on_evict``, the default): what ``prepare_store`` plans is copied by the evicting
    call, under the service's lock. With a write-back thread the driver turns it off: an eviction of a block whose
    hash the tier does not hold (no write-back got there first) drops it from the tier (a later miss) instead of
    copying it under the lock; ``prepare_store`` then plans no store, and an eviction of a block whose write-back is
    still in flight does not wait for that copy either: its slot is ``torn`` (the block may be written while the
    copy reads it), and ``writeback.finish`` aborts it instead of committing it.

    A restore (``restore.stage``) ``pin``-s the committed slots it reads (off the LRU, so the evictions its own
    allocation causes cannot take them), and ``unpin``-s them after the copy; a failed restore ``fence``-s them
    (dropped: their content is not trusted any more). The copy runs with the service's lock released:
    ``restoring`` holds each staged restore's pinned slots, and the manager's ``held_outside`` its pool
    references (its chain), under the same key, until ``restore.finish``; a pinned slot is never staged by a second
    restore (that one stops its walk there: a miss).

    Events (into the pool cache's pending list, ``cache.events``): BlockStored(medium "CPU") when a slot is
    committed; BlockRemoved only when the last copy of a hash goes -- medium "CPU" when a slot is dropped while the
    pool holds no block of that hash, medium "" (the pool's) when an evicted block is not kept (no slot, or no copy
    on eviction) or an offload fails (the pool's copy is gone already). The pool's own eviction of a block the tier
    keeps is no event (``prepare_store`` reports only the hashes that are gone; one the same call cached again in
    the pool is not gone).

    Counters (``num_*``, since start; ``tier_stats.TIER_FIGURES`` puts them in PoolStats, Stats.host_tier): offloaded
    (of them written back), restored, offload and restore failures (the latter fenced), torn, dropped, unkept.

    ::

        plan.evicted [7 (h1)] -> prepare_store: pairs [(7, 3)], pending {h1: 3} -> copy -> commit([3]): slot_of_hash {h1: 3}

    Invariants (``check_invariants``):
      - every ready slot (below ``num_ready``) is exactly one of free (``free``), pending (an offload not confirmed: ``pending_hashes``) or
        committed (``slot_of_hash``); ``entries`` holds the pending and committed slots' content;
      - a hash is in at most one slot (committed or pending), and every entry's hash matches its content chain;
      - ``lru`` and ``pinned`` split the committed slots (disjoint); the pinned slots are exactly those of the
        restores in flight (``restoring``), each pinned by one of them;
      - the write-back's scan hint: each of the pool's first ``scan_skip`` evictable blocks (when the last of them
        is still ``scan_mark``) is in flight or has its hash in a slot, committed or pending; the scan reads the
        pool's evictable LRU in its dict order, which is its LRU order (it is never reordered, only appended to);
      - between calls (the driver runs every store plan before the call returns) the pending slots are exactly
        the in-flight write-backs' (``inflight``), each of a block still cached in the pool under its slot's hash
        (an eviction of one waits for its copy), or ``torn`` (evicted without waiting: never committed).
    """

    def __init__(self, manager: KVCacheManager, num_slots: int, num_ready: int | None = None) -> None:
        """The tier of ``manager``'s pool: its prefix cache keeps its evictions for the tier from now on."""
        if num_slots < 1:
            raise InvalidArgumentError(f"the host tier needs at least one block, got {num_slots}")
        self.num_slots: int = num_slots
        self.manager: KVCacheManager = manager
        self.cache = manager.allocator.cache  # the pool's prefix cache: its index, LRU and pending events (read)
        self.cache.keep_evictions()
        self.cache.policy = MarkWatch(self.cache.policy, self)  # (an unpark of the scan mark voids the hint)
        self.num_ready: int = 0  # slots whose memory is there (the tier is allocated in the background)
        self.free: list[int] = []  # a stack: the lowest slot on top
        self.make_ready(num_slots if num_ready is None else num_ready)
        # slot -> content (pending or committed); out of the garbage collector's walks (core/block_records.py)
        self.entries: BlockRecords = BlockRecords(num_slots)
        self.slot_of_hash: dict[bytes, int] = {}  # committed slots: matchable
        self.pending_hashes: dict[bytes, int] = {}  # slots whose offload is not confirmed yet
        self.lru: OrderedDict[int, None] = OrderedDict()  # committed, unpinned slots, oldest first
        self.pinned: set[int] = set()  # committed slots a restore reads
        self.offload_on_evict: bool = True  # False: an eviction the tier holds no copy of drops it (no copy)
        # key -> its pinned slots, of each restore staged and not finished (its chain: manager.held_outside[key])
        self.restoring: dict[int, list[int]] = {}
        self.next_restore_key: int = 0
        self.inflight: dict[int, int] = {}  # pool block -> host slot: a write-back copying it (the slot pending)
        self.torn: set[int] = set()  # slots of in-flight write-backs whose block was evicted meanwhile: to abort
        self.num_written_back: int = 0
        self.num_torn: int = 0  # write-back blocks an eviction overtook (aborted, not a failure)
        # The write-back's scan resumes past the LRU's first ``scan_skip`` blocks, each held by the tier or in
        # flight when last scanned; ``scan_mark`` is the last of them (a hint, checked before use: ``scan_start``;
        # -1: reset, a hash the pool holds left the tier, or the mark was taken back into use).
        self.scan_skip: int = 0
        self.scan_mark: int = -1
        self.num_offloaded: int = 0  # committed offloads
        self.num_offload_failed: int = 0
        self.num_restored: int = 0  # blocks restored into the pool
        self.num_restore_failed: int = 0
        self.num_dropped: int = 0  # slots dropped by the host LRU
        self.num_unkept: int = 0  # evicted pool blocks the tier did not keep (no copy on eviction, or no slot)

    def make_ready(self, num_ready: int) -> None:
        """Slots ``[0, num_ready)`` have their memory now: the new ones join the free slots."""
        num_ready = min(num_ready, self.num_slots)
        if num_ready > self.num_ready:
            self.free[:0] = range(num_ready - 1, self.num_ready - 1, -1)
            self.num_ready = num_ready

    @property
    def num_committed(self) -> int:
        return len(self.slot_of_hash)

    @property
    def num_used(self) -> int:
        """Ready slots holding a block: committed or pending."""
        return self.num_ready - len(self.free)

    # ------------------------------------------------------------------ offload
    def prepare_store(self, evicted: EvictedBlocks) -> StorePlan:
        """The pool evicted ``evicted`` (a plan's ``AppendPlan.evicted``): plan a store of each block whose hash the
        tier does not hold, and report (BlockRemoved) the hashes that no tier keeps (those the tier had no slot
        for). Under the service's lock, right after the core's call: a few dict lookups a block, the names bound
        once."""
        block_ids, entries = evicted
        if not block_ids:
            return NO_STORES
        gone: list[bytes] = []
        dropped: list[bytes] = []
        stores: list[tuple[int, int]] = []
        wait = False
        self.scan_skip = max(0, self.scan_skip - len(block_ids))  # the evicted blocks were the LRU's first
        slot_of_hash, pending, lru, inflight, torn = self.slot_of_hash, self.pending_hashes, self.lru, self.inflight, self.torn
        held = 0
        for entry in entries:  # the tier's slots of this batch's hashes are dropped last (their content is here)
            slot = slot_of_hash.get(entry.block_hash)
            if slot is not None:
                held += 1
                if slot in lru:
                    lru.move_to_end(slot)
        offload = self.offload_on_evict
        # all of them committed in the tier (the write-back got there first): nothing to plan, nothing gone
        for block_id, entry in () if held == len(entries) else zip(block_ids, entries):
            h = entry.block_hash
            if h in slot_of_hash:
                continue
            pending_slot = pending.get(h)
            if pending_slot is not None:
                writing = inflight.get(block_id)
                if writing is not None:  # its write-back reads it: it must complete before anyone writes,
                    if offload:
                        wait = True
                    else:  # or, rather than wait under the lock, its slot is never trusted
                        torn.add(writing)
                if pending_slot in torn:  # never to be committed: the pool's copy was the last
                    gone.append(h)
                continue
            if not offload:  # no copy on the evicting call's path: the tier does not keep it
                gone.append(h)
                self.num_unkept += 1
                continue
            slot = self.take_slot(dropped)
            if slot is None:
                self.num_unkept += 1
                if h not in dropped:  # a slot of it dropped above (the pool evicts it in this batch too) said it
                    gone.append(h)
                continue
            self.entries[slot] = entry
            pending[h] = slot
            stores.append((block_id, slot))
        events = self.cache.events
        if events is not None:
            if dropped:
                events.append(BlockRemoved(tuple(dropped), HOST_MEDIUM))
            in_pool = self.cache.block_of_hash
            gone = [h for h in gone if h not in in_pool]  # cached again by the same call: not gone
            if gone:
                events.append(BlockRemoved(tuple(gone)))
        return StorePlan(np.array(stores, dtype=np.int32) if stores else NO_PAIRS, wait)

    def take_slot(self, dropped: list[bytes]) -> int | None:
        """A free slot, else the LRU's oldest committed one (its hash joins ``dropped`` when the pool has no block
        of it), else None."""
        if self.free:
            return self.free.pop()
        if not self.lru:
            return None
        slot, _ = self.lru.popitem(last=False)
        h = self.entries.pop_hash(slot)
        del self.slot_of_hash[h]
        self.num_dropped += 1
        if h not in self.cache.block_of_hash:
            dropped.append(h)
        else:  # a pool block of it may lie in the write-back's skipped run: scan it again
            self.scan_skip = -1
        return slot

    def commit(self, slots: list[int], stored: list[BlockStored] | None = None,
               hashes: list[bytes] | None = None) -> None:
        """The offloads into ``slots`` completed: the slots are matchable (BlockStored, medium "CPU"; ``stored``:
        those events, built ahead with ``host_stored_runs`` of the slots' entries, off the lock; else built here).
        ``hashes``: the slots' hashes, read ahead off the lock (else read here: a cold record each)."""
        pending, slot_of_hash, lru, events = self.pending_hashes, self.slot_of_hash, self.lru, self.cache.events
        if hashes is None:
            hashes = list(map(self.entries.hash_of, slots))
        for slot, h in zip(slots, hashes):
            del pending[h]
            slot_of_hash[h] = slot
            lru[slot] = None
        if events is not None and slots:
            events.extend(host_stored_runs([self.entries[s] for s in slots]) if stored is None else stored)
        self.num_offloaded += len(slots)

    def abort(self, slots: list[int], failed: bool = True) -> None:
        """The offloads into ``slots`` failed: the slots are free, their content lost (BlockRemoved, the pool's
        medium, for each hash the pool no longer holds). Not ``failed``: torn write-backs, whose hashes' removal
        ``prepare_store`` said already (as the eviction's)."""
        gone = []
        for slot in slots:
            h = self.entries.pop(slot).block_hash
            del self.pending_hashes[h]
            self.free.append(slot)
            if h not in self.cache.block_of_hash:
                gone.append(h)
            else:
                self.scan_skip = -1  # (reset)
        if gone and failed and self.cache.events is not None:
            self.cache.events.append(BlockRemoved(tuple(gone)))
        if failed:
            self.num_offload_failed += len(slots)

    # ------------------------------------------------------------------ write-back (writeback.py)
    def scan_start(self, evictable: OrderedDict[int, None]) -> int:
        """Where the write-back's scan resumes: past the first ``scan_skip`` blocks of the LRU if the last of them is
        still ``scan_mark`` (blocks join the LRU at its end; an eviction from its head is subtracted by ``prepare_store``;
        a block taken back from inside the run moves the mark; the mark itself taken back voids the hint:
        ``scan_mark.MarkWatch``), else 0."""
        return self.scan_from(evictable)[0]

    def scan_from(self, evictable: OrderedDict[int, None]) -> tuple[int, Iterator[int]]:
        """``scan_start``, and an iterator over the LRU from there on: the run is walked once, in the LRU's dict
        order (``dict.__iter__``: a C walk of its entries array, ~3 us per 1,000 blocks warm on the 2-core VM, not
        the OrderedDict's linked list, which looks each node up in its table: ~10); the pool's evictable LRU is only
        appended to and deleted from, never reordered, so the two orders are one (checked by ``check_invariants``)."""
        skip, blocks = self.scan_skip, dict.__iter__(evictable)
        if skip > 0 and next(islice(blocks, skip - 1, skip), None) != self.scan_mark:
            skip, blocks = 0, dict.__iter__(evictable)
        self.scan_skip = max(skip, 0)  # -1: reset (a pool-held hash left the tier) until this plan's scan ends
        return self.scan_skip, blocks

    # ------------------------------------------------------------------ restore
    def pin(self, slots: list[int]) -> None:
        """Committed ``slots`` a restore reads: off the LRU until ``unpin``."""
        for slot in slots:
            del self.lru[slot]
            self.pinned.add(slot)

    def unpin(self, slots: list[int]) -> None:
        """The restore is over: back on the LRU, as the most recently used."""
        for slot in slots:
            self.pinned.discard(slot)
            self.lru[slot] = None

    def fence(self, slots: list[int]) -> None:
        """A restore from pinned ``slots`` failed or was cut short: drop them (their content is not trusted)."""
        gone = []
        for slot in slots:
            self.pinned.discard(slot)
            h = self.entries.pop(slot).block_hash
            del self.slot_of_hash[h]
            self.free.append(slot)
            if h not in self.cache.block_of_hash:
                gone.append(h)
            else:
                self.scan_skip = -1  # (reset)
        if gone and self.cache.events is not None:
            self.cache.events.append(BlockRemoved(tuple(gone), HOST_MEDIUM))
        self.num_restore_failed += len(slots)

    def stored_events(self) -> list[BlockStored]:
        """BlockStored (medium "CPU") of every committed slot whose hash the pool holds no block of (a snapshot)."""
        in_pool = self.cache.block_of_hash
        return [host_stored(self.entries[s]) for h, s in self.slot_of_hash.items() if h not in in_pool]

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        check_host_tier(self)  # (host_tier_checks.py)
