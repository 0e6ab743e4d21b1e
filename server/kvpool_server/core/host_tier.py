"""HostTier: the second tier of the prefix cache -- sealed blocks evicted from the pool, kept in host memory.

Pure bookkeeping, as ``PrefixCache`` is: it names host slots (block-sized rows of the host tier's pool,
``device.HostTierPool``) and never touches memory; the service runs the copies it plans and reports back.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from itertools import islice

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH, block_hash
from kvpool_server.core.errors import InvalidArgumentError, InvariantViolationError
from kvpool_server.core.kv_event_types import BlockRemoved, BlockStored, CachedBlock

HOST_MEDIUM = "CPU"  # the events' medium of the host tier
NO_PAIRS = np.zeros((0, 2), dtype=np.int32)
NO_PAIRS.flags.writeable = False


class HostTier:
    """Host slots holding sealed blocks the pool evicted: hash -> slot, and their own LRU.

    The pool's prefix cache calls ``spill`` with the blocks it evicts: each whose hash no slot holds yet gets a
    slot (a free one, else the host LRU's oldest is dropped) and an offload ``(gpu block, host slot)`` joins
    ``staged``. The service takes them (``take_staged``), copies the blocks out *before* anyone writes into the
    evicted blocks (their new owners' clearing included), then calls ``commit`` (the copy completed: the slot is
    matchable) or ``abort`` (it failed: the slot is free again, the content lost). A slot is matchable only once
    committed: no request is ever served from a slot whose bytes are not all there.

    Write-back (``plan_writeback``, from the service's background thread): the pool's evictable blocks next in
    line are copied ahead, off any call's path, and committed when the copy completed (``finish_writeback``); an
    eviction then finds their hash in the tier and costs no copy. A block being written back stays evictable: if
    an allocation evicts it, ``spill`` sets ``must_wait`` and the service waits for that copy before anything
    writes into the block.

    Offload on eviction (``offload_on_evict``, the default): what ``spill`` stages is copied by the evicting call,
    under the service's lock. With a write-back thread the service turns it off: an eviction of a block whose hash
    the tier does not hold (no write-back got there first) drops it from the tier (a later miss) instead of
    copying it under the lock; ``spill`` then stages nothing, and an eviction of a block whose write-back is still
    in flight does not wait for that copy either: its slot is ``torn`` (the block may be written while the copy
    reads it), and ``finish_writeback`` aborts it instead of committing it.

    A restore (``tier_restore.stage``) ``pin``-s the committed slots it reads (off the LRU, so the evictions its
    own allocation causes cannot take them), and ``unpin``-s them after the copy; a failed restore ``fence``-s
    them (dropped: their content is not trusted any more). The copy runs with the service's lock released:
    ``restoring`` holds each staged restore's pool references (its chain) until ``tier_restore.finish``; a pinned
    slot is never staged by a second restore (that one stops its walk there: a miss).

    Events (into the cache's pending list, ``events``): BlockStored(medium "CPU") when a slot is committed;
    BlockRemoved only when the last copy of a hash goes -- medium "CPU" when a slot is dropped while the pool holds
    no block of that hash, medium "" (the pool's) when an offload fails (the pool's copy is gone already). The
    pool's own eviction of a block the tier keeps is no event (``spill`` returns only the hashes that are gone).

    Counters (``num_*``, since start; ``checks.tier_stats`` puts them in PoolStats, Stats.host_tier): offloaded
    (of them written back), restored, offload and restore failures (the latter fenced), torn, dropped, unkept.

    ::

        pool evicts block 7 (h1)  ->  staged [(7, 3)], pending {h1: 3}  ->  copy  ->  commit([3]): slot_of_hash {h1: 3}

    Invariants (``check_invariants``):
      - every ready slot (below ``num_ready``) is exactly one of free (``free``), pending (an offload not confirmed: ``pending_hashes``) or
        committed (``slot_of_hash``); ``entries`` holds the pending and committed slots' content;
      - a hash is in at most one slot (committed or pending), and every entry's hash matches its content chain;
      - ``lru`` and ``pinned`` split the committed slots (disjoint); the pinned slots are exactly those of the
        restores in flight (``restoring``), each pinned by one of them;
      - ``staged`` is empty between calls (the service runs every offload before the call returns), and so is
        ``must_wait``; between calls the pending slots are exactly the in-flight write-backs' (``inflight``), each
        of a block still cached in the pool under its slot's hash (an eviction of one waits for its copy), or
        ``torn`` (evicted without waiting: never committed).
    """

    def __init__(self, num_slots: int, num_ready: int | None = None) -> None:
        if num_slots < 1:
            raise InvalidArgumentError(f"the host tier needs at least one block, got {num_slots}")
        self.num_slots: int = num_slots
        self.num_ready: int = 0  # slots whose memory is there (the tier is allocated in the background)
        self.free: list[int] = []  # a stack: the lowest slot on top
        self.make_ready(num_slots if num_ready is None else num_ready)
        self.entries: dict[int, CachedBlock] = {}  # slot -> content (pending or committed)
        self.slot_of_hash: dict[bytes, int] = {}  # committed slots: matchable
        self.pending_hashes: dict[bytes, int] = {}  # slots whose offload is not confirmed yet
        self.lru: OrderedDict[int, None] = OrderedDict()  # committed, unpinned slots, oldest first
        self.pinned: set[int] = set()  # committed slots a restore reads
        self.offload_on_evict: bool = True  # False: an eviction the tier holds no copy of drops it (no copy)
        # key -> (its pinned slots, its pool references: the chain) of each restore staged and not finished
        self.restoring: dict[int, tuple[list[int], np.ndarray]] = {}
        self.next_restore_key: int = 0
        self.staged: list[tuple[int, int]] = []  # (pool block, host slot) offloads to run
        self.inflight: dict[int, int] = {}  # pool block -> host slot: a write-back copying it (the slot pending)
        self.must_wait: bool = False  # a block of an in-flight write-back was evicted: wait for it before writing
        self.torn: set[int] = set()  # slots of in-flight write-backs whose block was evicted meanwhile: to abort
        self.num_written_back: int = 0
        self.num_torn: int = 0  # write-back blocks an eviction overtook (aborted, not a failure)
        self.gpu_index: dict[bytes, int] = {}  # the pool's prefix cache's block_of_hash (PrefixCache.attach_tier)
        self.events: list | None = None  # the cache's pending event list, when a KVEventLog is attached
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
    def spill(self, block_ids: list[int], entries: list[CachedBlock]) -> list[bytes]:
        """The pool evicts ``block_ids`` (with their ``entries``): stage an offload of each whose hash the tier
        does not hold. Returns the hashes that no tier keeps (those the tier had no slot for)."""
        gone: list[bytes] = []
        dropped: list[bytes] = []
        for entry in entries:  # the tier's slots of this batch's hashes are dropped last (their content is here)
            slot = self.slot_of_hash.get(entry.block_hash)
            if slot is not None and slot in self.lru:
                self.lru.move_to_end(slot)
        for block_id, entry in zip(block_ids, entries):
            h = entry.block_hash
            if h in self.slot_of_hash:
                continue
            if h in self.pending_hashes:
                if block_id in self.inflight:  # its write-back reads it: it must complete before anyone writes,
                    if self.offload_on_evict:
                        self.must_wait = True
                    else:  # or, rather than wait under the lock, its slot is never trusted
                        self.torn.add(self.inflight[block_id])
                if self.pending_hashes[h] in self.torn:  # never to be committed: the pool's copy was the last
                    gone.append(h)
                continue
            if not self.offload_on_evict:  # no copy on the evicting call's path: the tier does not keep it
                gone.append(h)
                self.num_unkept += 1
                continue
            slot = self._take_slot(dropped)
            if slot is None:
                self.num_unkept += 1
                if h not in dropped:  # a slot of it dropped above (the pool evicts it in this batch too) said it
                    gone.append(h)
                continue
            self.entries[slot] = entry
            self.pending_hashes[h] = slot
            self.staged.append((block_id, slot))
        if dropped and self.events is not None:
            self.events.append(BlockRemoved(tuple(dropped), HOST_MEDIUM))
        return gone

    def _take_slot(self, dropped: list[bytes]) -> int | None:
        """A free slot, else the LRU's oldest committed one (its hash joins ``dropped`` when the pool has no block
        of it), else None."""
        if self.free:
            return self.free.pop()
        if not self.lru:
            return None
        slot, _ = self.lru.popitem(last=False)
        h = self.entries.pop(slot).block_hash
        del self.slot_of_hash[h]
        self.num_dropped += 1
        if h not in self.gpu_index:
            dropped.append(h)
        return slot

    def take_staged(self) -> np.ndarray:
        """The staged offloads as int32 ``[n, 2]`` (pool block, host slot), and none staged any more."""
        if not self.staged:
            return NO_PAIRS
        pairs = np.array(self.staged, dtype=np.int32)
        self.staged = []
        return pairs

    def commit(self, slots: list[int]) -> None:
        """The offloads into ``slots`` completed: the slots are matchable (BlockStored, medium "CPU")."""
        for slot in slots:
            entry = self.entries[slot]
            del self.pending_hashes[entry.block_hash]
            self.slot_of_hash[entry.block_hash] = slot
            self.lru[slot] = None
            if self.events is not None:
                self.events.append(host_stored(entry))
        self.num_offloaded += len(slots)

    def abort(self, slots: list[int], failed: bool = True) -> None:
        """The offloads into ``slots`` failed: the slots are free, their content lost (BlockRemoved, the pool's
        medium, for each hash the pool no longer holds). Not ``failed``: torn write-backs, whose hashes' removal
        ``spill`` said already (as the eviction's)."""
        gone = []
        for slot in slots:
            h = self.entries.pop(slot).block_hash
            del self.pending_hashes[h]
            self.free.append(slot)
            if h not in self.gpu_index:
                gone.append(h)
        if gone and failed and self.events is not None:
            self.events.append(BlockRemoved(tuple(gone)))
        if failed:
            self.num_offload_failed += len(slots)

    # ------------------------------------------------------------------ write-back
    def plan_writeback(self, evictable: OrderedDict[int, None], entries: dict[int, CachedBlock],
                       max_blocks: int) -> np.ndarray:
        """Copy ahead (off any call's path): up to ``max_blocks`` of the pool's evictable blocks next in line for
        eviction (the LRU's oldest, scanning at most ``8 * max_blocks``) whose hash no slot holds get a slot (free,
        else the host LRU's oldest). They stay in the pool, matchable and evictable; ``inflight`` says a copy reads
        them, so that an eviction of one makes the service wait for it (``must_wait``) before anything writes into
        it. Returns the pairs (pool block, host slot) to copy; ``finish_writeback`` settles them."""
        pairs: list[tuple[int, int]] = []
        dropped: list[bytes] = []
        for block_id in islice(evictable, 8 * max_blocks):
            if len(pairs) >= max_blocks:
                break
            entry = entries[block_id]
            h = entry.block_hash
            if block_id in self.inflight or h in self.slot_of_hash or h in self.pending_hashes:
                continue
            slot = self._take_slot(dropped)
            if slot is None:
                break
            self.entries[slot] = entry
            self.pending_hashes[h] = slot
            self.inflight[block_id] = slot
            pairs.append((block_id, slot))
        if dropped and self.events is not None:
            self.events.append(BlockRemoved(tuple(dropped), HOST_MEDIUM))
        return np.array(pairs, dtype=np.int32).reshape(-1, 2)

    def finish_writeback(self, pairs: np.ndarray, ok: bool) -> None:
        """The write-back of ``pairs`` completed (``ok``: its slots are committed) or failed (aborted)."""
        slots: list[int] = []
        torn: list[int] = []
        for block_id, slot in pairs.tolist():
            del self.inflight[block_id]
            (torn if slot in self.torn else slots).append(slot)
        self.torn.difference_update(torn)
        if torn:
            self.num_torn += len(torn)
            self.abort(torn, failed=False)  # their block was evicted while the copy read it: the bytes may be torn
        if ok:
            self.commit(slots)
            self.num_written_back += len(slots)
        else:
            self.abort(slots)

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
            if h not in self.gpu_index:
                gone.append(h)
        if gone and self.events is not None:
            self.events.append(BlockRemoved(tuple(gone), HOST_MEDIUM))
        self.num_restore_failed += len(slots)

    def stored_events(self) -> list[BlockStored]:
        """BlockStored (medium "CPU") of every committed slot whose hash the pool holds no block of (a snapshot)."""
        return [host_stored(self.entries[s]) for h, s in self.slot_of_hash.items() if h not in self.gpu_index]

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        committed = set(self.slot_of_hash.values())
        pending = set(self.pending_hashes.values())
        free = set(self.free)
        if len(free) != len(self.free) or free & committed or free & pending or committed & pending:
            raise InvariantViolationError("a host slot is in two of free, pending and committed")
        if len(free) + len(committed) + len(pending) != self.num_ready or (free and max(free) >= self.num_ready):
            raise InvariantViolationError("a ready host slot is neither free, pending nor committed")
        if set(self.entries) != committed | pending:
            raise InvariantViolationError("the host tier's entries are not exactly its pending and committed slots")
        for h, slot in [*self.slot_of_hash.items(), *self.pending_hashes.items()]:
            entry = self.entries[slot]
            if entry.block_hash != h:
                raise InvariantViolationError(f"host slot {slot} is indexed under another hash than its entry's")
            if block_hash(entry.parent_hash, entry.token_ids, entry.salt, entry.extra) != h:
                raise InvariantViolationError(f"host slot {slot}'s hash does not match its content chain")
        if set(self.lru) & self.pinned or set(self.lru) | self.pinned != committed:
            raise InvariantViolationError("the host LRU and the pinned slots do not split the committed slots")
        restoring = [slot for slots, _ in self.restoring.values() for slot in slots]
        if len(restoring) != len(set(restoring)) or set(restoring) != self.pinned:
            raise InvariantViolationError("the pinned slots are not exactly the in-flight restores', each once")
        if self.staged or self.must_wait:
            raise InvariantViolationError(f"{len(self.staged)} offloads are staged between calls (or one is waited for)")
        if set(self.inflight.values()) != pending:
            raise InvariantViolationError("between calls, the pending slots are not exactly the in-flight write-backs'")
        if not self.torn <= pending:
            raise InvariantViolationError("a torn slot is not an in-flight write-back's")
        for block_id, slot in self.inflight.items():
            if slot not in self.torn and self.gpu_index.get(self.entries[slot].block_hash) != block_id:
                raise InvariantViolationError(f"in-flight write-back of block {block_id} no longer cached in the pool")


def host_stored(entry: CachedBlock) -> BlockStored:
    """A one-block BlockStored of the host tier."""
    token_ids = array("I")
    token_ids.frombytes(entry.token_ids.astype(np.uint32, copy=False).tobytes())
    parent = None if entry.parent_hash == NONE_HASH else entry.parent_hash
    return BlockStored((entry.block_hash,), parent, token_ids, int(entry.token_ids.size), entry.extra,
                       salt=entry.salt, medium=HOST_MEDIUM)
