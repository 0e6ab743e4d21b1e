"""PrefixCache: the content index of sealed full blocks (hash -> block) and the LRU of cached blocks nobody holds."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat
from operator import itemgetter

import numpy as np

from kvpool_server.core.block_hash import PUBLIC_SALT, block_hash
from kvpool_server.core.cached_records import CachedRecords
from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.eviction_policy import EvictionPolicy, LruEviction
from kvpool_server.core.kv_event_types import BlockRemoved, BlockStored, CachedBlock
from kvpool_server.core.types import EvictedBlocks

__all__ = ["CachedBlock", "PrefixCache"]

_FIRST = itemgetter(0)


class PrefixCache:
    """Which physical blocks hold a sealed full block of known content, and which of those may be evicted.

    Pure bookkeeping: it never allocates and never touches KV memory. The allocator owns one and asks it two
    things: which blocks reaching ref count 0 keep their content (``is_cached``: they are ``park``-ed on the
    evictable LRU instead of the free list), and which blocks to take when the free list runs dry (``evict``: those
    the eviction policy names -- ``policy``, eviction_policy.py: the least recently used, or LRFU's least
    valuable -- whose hash is then forgotten). A prefix match takes blocks back off the LRU (``unpark``).

    The LRU is an OrderedDict (block id -> None), oldest first: O(1) park, unpark of any block and eviction from the
    front. A released sequence's blocks are parked tail first (the allocator reverses them), so that the leaves of a
    hash chain are evicted before the blocks they extend -- evicting a parent first would strand its children,
    unreachable by any match, as vLLM's free queue also avoids.

    ::

        block_of_hash {h0: 7, h1: 3, h2: 9}     evictable (LRU, oldest first): [9, 3]      ref_count: 7 -> 2
        entries[3] = (h1, parent h0, salt, extra) + tokens row 3                                     3, 9 -> 0

    Invariants (``check_invariants``, with the allocator's ref counts):
      - ``block_of_hash`` and ``entries`` (a ``CachedRecords``: its own invariant) are the same relation read both ways, and ``is_cached`` marks exactly
        the blocks in ``entries``;
      - ``is_public`` marks exactly the cached blocks whose salt is ``PUBLIC_SALT`` (a public prefix's blocks, the
        only ones rows of several tenants may hold: ``TenantLedger``), and ``num_public`` counts them;
      - every cached block's hash is ``block_hash(parent_hash, token_ids, salt, extra)`` of its recorded content;
      - the evictable LRU holds exactly the cached blocks whose ref count is 0, each once;
      - ``evicted_ids`` / ``evicted_entries`` (with ``keep_evictions``) are empty between calls: the manager moves a
        call's evictions into its plan (``AppendPlan.evicted``) before it returns.
      - the eviction policy's own invariants hold (``policy.check_invariants``).
    """

    def __init__(self, num_blocks: int, policy: EvictionPolicy | None = None) -> None:
        self.block_of_hash: dict[bytes, int] = {}
        # block_id -> what its hash was computed from; out of the garbage collector's walks (cached_records.py)
        self.entries: CachedRecords = CachedRecords(num_blocks)
        self.is_cached: np.ndarray = np.zeros(num_blocks, dtype=bool)
        self.is_public: np.ndarray = np.zeros(num_blocks, dtype=bool)  # cached with PUBLIC_SALT
        self.num_public: int = 0
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0, oldest (first to evict) first
        self.num_evicted: int = 0
        self.policy: EvictionPolicy = LruEviction() if policy is None else policy  # names the blocks evicted
        # A KVEventLog's ``pending`` list when one is attached (kv_events.py, a bounded list): the entries stored,
        # BlockRemoved.
        self.events: list[CachedBlock | BlockRemoved | BlockStored] | None = None
        # With ``keep_evictions``: the blocks this call evicted (and what they held), for its plan; their
        # removal is the keeper's to report. Cleared in place (``take_evicted``): the manager holds the list.
        self.keeps_evictions: bool = False
        self.evicted_ids: list[int] = []
        self.evicted_entries: list[CachedBlock] = []

    def keep_evictions(self) -> None:
        """Evicted blocks go to a keeper outside the core (the host tier, docs/prefix-caching.md): each call's
        evictions travel in its plan (``AppendPlan.evicted``) and the keeper, not the cache, reports which hashes
        are gone (BlockRemoved)."""
        self.keeps_evictions = True

    def take_evicted(self) -> EvictedBlocks:
        """The evictions recorded since the last take (``keep_evictions``), and none recorded any more."""
        taken = EvictedBlocks(self.evicted_ids[:], self.evicted_entries[:])
        self.evicted_ids.clear()
        self.evicted_entries.clear()
        return taken

    @property
    def num_cached(self) -> int:
        return len(self.entries)

    @property
    def num_evictable(self) -> int:
        return len(self.evictable)

    def insert(self, block_id: int, entry: CachedBlock) -> bool:
        """Make an in-use full block matchable (its sealing). A hash already cached (the same content in another
        block) or a block already cached is left as it is: returns False."""
        if entry.block_hash in self.block_of_hash or self.is_cached[block_id]:
            return False
        self.entries[block_id] = entry  # first: ValueError (nothing changed) for token ids of another width
        self.block_of_hash[entry.block_hash] = block_id
        self.is_cached[block_id] = True
        if entry.salt == PUBLIC_SALT:
            self.is_public[block_id] = True
            self.num_public += 1
        if self.events is not None:
            self.events.append(entry)  # made a BlockStored (with the run it belongs to) when the batch is published
        return True

    def insert_many(self, block_ids: list[int], entries: list[CachedBlock]) -> list[int]:
        """``insert`` of each (block, entry) pair in order, with the same answers (``insert_blocks`` of their
        fields). Returns the positions of the public entries inserted."""
        if not entries:
            return []
        return self.insert_blocks(block_ids, [e.block_hash for e in entries], [e.parent_hash for e in entries],
                                  np.stack([e.token_ids for e in entries]), [e.salt for e in entries],
                                  [e.extra for e in entries])

    def insert_blocks(self, block_ids: list[int] | np.ndarray, hashes: list[bytes], parents: Sequence[bytes],
                      tokens: np.ndarray, salts: Sequence[bytes], extras: Sequence[bytes]) -> list[int]:
        """``insert`` of each block ``block_ids[k]`` with the entry (``hashes[k]``, ``parents[k]``, ``tokens[k]``,
        ``salts[k]``, ``extras[k]``), in order, with the same answers -- a hash or a block already cached, by the
        cache or by an earlier pair, is left as it is -- in one pass (a decode step seals hundreds): the two
        indexes, the records (the token ids one scatter), the arrays and the events updated once for the batch;
        no CachedBlock made but for the events. ``tokens``: uint32 [len(block_ids), block_size], not written
        after (the events may keep rows of it). Returns the positions of the public entries inserted."""
        block_of_hash = self.block_of_hash
        index: list[int] | np.ndarray  # the ids for NumPy (an array indexes faster than a list), ``ids`` for Python
        if isinstance(block_ids, np.ndarray):
            index, ids = block_ids.astype(np.intp, copy=False), block_ids.tolist()
        else:
            index = ids = block_ids
        self.entries.check_tokens(tokens, len(ids))  # ValueError before anything changes
        num_hashes = len(block_of_hash)
        if block_of_hash.keys().isdisjoint(hashes):
            # the pairs' hashes new to the cache (a decode step's seal): each structure updated in one call -- unless
            # two pairs repeat a hash or a block is cached (or repeated), which the loop below answers, undone
            block_of_hash.update(zip(hashes, ids))
            if len(block_of_hash) - num_hashes == len(hashes) and self.entries.add_new(
                    ids, zip(hashes, parents, salts, extras), tokens, index):
                return self._stored_new(index, hashes, parents, tokens, salts, extras)
            for h in hashes:
                block_of_hash.pop(h, None)
        cached, seen = self.entries.records, set()
        taken: list[int] = []  # the positions inserted
        for k, (block_id, h) in enumerate(zip(ids, hashes)):
            if h in block_of_hash or cached[block_id] is not None or block_id in seen:
                continue
            block_of_hash[h] = block_id
            seen.add(block_id)
            taken.append(k)
        if not taken:
            return []
        if len(taken) < len(ids):
            pick = [*map(ids.__getitem__, taken)], [*map(hashes.__getitem__, taken)], \
                [*map(parents.__getitem__, taken)], [*map(salts.__getitem__, taken)], [*map(extras.__getitem__, taken)]
            ids, hashes, parents, salts, extras = pick
            tokens = tokens[taken]
        self.entries.add_new(ids, zip(hashes, parents, salts, extras), tokens)  # all distinct and new
        return [taken[k] for k in self._stored_new(ids, hashes, parents, tokens, salts, extras)]

    def _stored_new(self, block_ids: list[int] | np.ndarray, hashes: list[bytes], parents: Sequence[bytes],
                    tokens: np.ndarray, salts: Sequence[bytes], extras: Sequence[bytes]) -> list[int]:
        """The rest of ``insert_blocks`` when every pair is new and the indexes and records hold them already: the
        arrays, the events. Returns the positions of the public entries."""
        self.is_cached[block_ids] = True
        public = [k for k, salt in enumerate(salts) if salt == PUBLIC_SALT] if PUBLIC_SALT in salts else []
        if public:
            self.is_public[np.asarray(block_ids)[public]] = True
            self.num_public += len(public)
        if self.events is not None:  # the entries stored, made BlockStored runs when the batch is published
            self.events.extend(map(tuple.__new__, repeat(CachedBlock), zip(hashes, parents, tokens, salts, extras)))
        return public

    def match(self, hashes: list[bytes]) -> list[int]:
        """The blocks of the longest run of ``hashes``, from the first, that are all cached."""
        blocks = []
        for h in hashes:
            block_id = self.block_of_hash.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def park(self, block_ids: np.ndarray) -> None:
        """Cached blocks whose ref count reached 0, in eviction order: they keep their content and hash."""
        for block_id in block_ids.tolist():
            self.evictable[block_id] = None
        self.policy.parked(block_ids, self.entries, self.evictable)

    def unpark(self, block_ids: np.ndarray) -> None:
        """Cached blocks taken back into use (a prefix match)."""
        for block_id in block_ids.tolist():
            del self.evictable[block_id]
        self.policy.unparked(block_ids)

    def evict(self, num: int) -> np.ndarray:
        """Forget ``num`` evictable blocks (``num`` <= ``num_evictable``), those the policy names; returns them.
        With ``keep_evictions``, they and their content are recorded for the call's plan (a keeper stores them
        before anyone writes into the returned blocks, and reports the hashes it does not keep); else their hashes
        are reported removed."""
        evictable, block_of_hash = self.evictable, self.block_of_hash
        block_ids = self.policy.victims(evictable, num)
        for block_id in block_ids:
            del evictable[block_id]
        records = self.entries.pop_records(block_ids)  # plain tuples: CachedBlocks made only for a keeper
        hashes = list(map(_FIRST, records))  # each record's block_hash
        self.policy.evicted(block_ids, hashes)
        for block_hash_i in hashes:
            del block_of_hash[block_hash_i]
        evicted = np.array(block_ids, dtype=np.int32)
        if self.keeps_evictions:
            self.evicted_ids.extend(block_ids)
            self.evicted_entries.extend(self.entries.blocks(block_ids, records))
        elif self.events is not None and hashes:
            self.events.append(BlockRemoved(tuple(hashes)))
        self.is_cached[evicted] = False
        if self.num_public:
            self.num_public -= int(np.count_nonzero(self.is_public[evicted]))
            self.is_public[evicted] = False
        self.num_evicted += num
        return evicted

    def check_invariants(self, ref_count: np.ndarray) -> None:
        self.entries.check_invariants()
        if {h: b for b, e in self.entries.items() for h in [e.block_hash]} != self.block_of_hash:
            raise InvariantViolationError("block_of_hash and the cached blocks' entries disagree")
        if set(np.flatnonzero(self.is_cached).tolist()) != set(self.entries):
            raise InvariantViolationError("is_cached does not mark exactly the cached blocks")
        public = {b for b, e in self.entries.items() if e.salt == PUBLIC_SALT}
        if set(np.flatnonzero(self.is_public).tolist()) != public or self.num_public != len(public):
            raise InvariantViolationError("is_public (or num_public) does not mark exactly the cached public blocks")
        for block_id, e in self.entries.items():
            if block_hash(e.parent_hash, e.token_ids, e.salt, e.extra) != e.block_hash:
                raise InvariantViolationError(f"cached block {block_id}'s hash does not match its content chain")
        if self.evicted_ids or self.evicted_entries:
            raise InvariantViolationError(f"{len(self.evicted_ids)} evictions left out of their call's plan")
        idle = set(np.flatnonzero(self.is_cached & (ref_count == 0)).tolist())
        if set(self.evictable) != idle:
            raise InvariantViolationError(
                f"the evictable LRU {sorted(self.evictable)[:8]} is not the cached blocks of ref count 0 {sorted(idle)[:8]}"
            )
        self.policy.check_invariants(self.evictable)
