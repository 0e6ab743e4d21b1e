"""LrfuEviction: the prefix cache's evictable blocks ranked by their decayed reuse count (LRFU), with a bounded
memory of evicted blocks' counts."""

from __future__ import annotations

import heapq
from collections import OrderedDict

import numpy as np

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.kv_event_types import CachedBlock

# A use counts half as much after this many tokens' worth of blocks parked since (the replay's choice on the
# conversation trace: docs/prefix-caching.md, "Eviction policy").
DEFAULT_HALF_LIFE_TOKENS = 12 << 20
DEFAULT_GHOST_FACTOR = 4  # evicted blocks remembered: this many times the pool's blocks
RANK_QUANTA = 16  # rank buckets a half-life (a use more is 16 buckets up)


class LrfuEviction:
    """Evicts the block of least combined recency-frequency (Lee et al.'s LRFU): each use of a block -- the end of
    a hold, when it is parked -- adds 1 to its count, and counts halve every ``half_life_tokens`` of blocks parked
    (the clock ticks one per block parked). A block reused by many requests over the last half-lives (a shared
    system prompt, a conversation that keeps coming back) outranks one used once more recently (the tail of a
    one-off prompt), which LRU would keep instead. Counts of evicted blocks are remembered by hash (``ghost``,
    at most ``ghost_limit``, the oldest forgotten first): a block recomputed after its eviction resumes its count,
    so the second use of a long-unseen prefix counts as one.

    A block's rank is ``log2(count) + decay * clock`` at its last use: the log of its count carried to a common
    time, so ranks compare at any later time and never change while a block waits. Blocks wait in buckets of
    1/RANK_QUANTA of a rank unit (``buckets``: bucket -> block ids in park order; ``bucket_ids``, a min-heap of the
    buckets' keys); victims come from the lowest bucket, first parked first (a sequence's tail before its head,
    as under LRU). A bucket may hold blocks taken back into use (not evictable): skipped when reached.

    Invariants (``check_invariants``): each block is in at most one bucket, ``bucket_of`` its key (-1: none), and
    every evictable block is in one; ``bucket_ids`` holds every bucket's key, at most ``max_buckets``; the ghost
    holds at most ``ghost_limit`` hashes (memory: about 100 bytes a remembered hash, 4 times the pool's blocks).
    """

    name = "lrfu"

    def __init__(self, num_blocks: int, block_size: int, half_life_tokens: int = DEFAULT_HALF_LIFE_TOKENS,
                 ghost_factor: int = DEFAULT_GHOST_FACTOR) -> None:
        self.decay: float = block_size / half_life_tokens  # half-lives per block parked
        self.clock: int = 0  # blocks parked so far
        self.rank: np.ndarray = np.zeros(num_blocks)  # log2(count) + decay * clock, at the block's last use
        self.known: np.ndarray = np.zeros(num_blocks, dtype=bool)  # ``rank`` is of the block's current content
        self.bucket_of: list[int] = [-1] * num_blocks
        self.buckets: dict[int, dict[int, None]] = {}
        self.bucket_ids: list[int] = []  # heap
        self.ghost: OrderedDict[bytes, float] = OrderedDict()  # evicted hash -> its rank
        self.ghost_limit: int = ghost_factor * num_blocks
        self.max_buckets: int = num_blocks + 1024  # a nonempty bucket holds a block: the rest are empty

    def parked(self, block_ids: list[int], entries: dict[int, CachedBlock], evictable: OrderedDict[int, None]) -> None:
        n = len(block_ids)
        if n == 0:
            return
        now = self.decay * self.clock
        ids = np.array(block_ids, dtype=np.int64)
        known = self.known[ids]
        past = np.where(known, self.rank[ids], -np.inf)
        if not known.all():
            ghost = self.ghost
            for k in np.flatnonzero(~known).tolist():
                past[k] = ghost.pop(entries[block_ids[k]].block_hash, -np.inf)
        rank = np.log2(1.0 + np.exp2(past - now)) + now  # one use more, decayed to now
        self.known[ids], self.rank[ids] = True, rank
        keys = (rank * RANK_QUANTA).astype(np.int64)
        buckets, bucket_of = self.buckets, self.bucket_of
        first = int(keys[0])
        if (keys == first).all():  # the common case: a prompt's blocks, used as often
            bucket = buckets.get(first)
            if bucket is None:
                bucket = buckets[first] = {}
                heapq.heappush(self.bucket_ids, first)
            for block_id in block_ids:
                old = bucket_of[block_id]
                if old != -1:
                    buckets[old].pop(block_id, None)
                bucket_of[block_id] = first
                bucket[block_id] = None
        else:
            for block_id, key in zip(block_ids, keys.tolist()):
                old = bucket_of[block_id]
                if old != -1:
                    buckets[old].pop(block_id, None)
                bucket = buckets.get(key)
                if bucket is None:
                    bucket = buckets[key] = {}
                    heapq.heappush(self.bucket_ids, key)
                bucket_of[block_id] = key
                bucket[block_id] = None
        self.clock += n
        if len(buckets) > self.max_buckets:  # emptied by re-parks and not reached by an eviction: dropped
            self.buckets = {key: bucket for key, bucket in buckets.items() if bucket}
            self.bucket_ids = list(self.buckets)
            heapq.heapify(self.bucket_ids)

    def victims(self, evictable: OrderedDict[int, None], num: int) -> list[int]:
        buckets, bucket_ids, bucket_of, out = self.buckets, self.bucket_ids, self.bucket_of, []
        while len(out) < num:
            if not bucket_ids:
                raise InvariantViolationError(f"LRFU: {num - len(out)} evictable blocks are in no bucket")
            key = bucket_ids[0]
            bucket = buckets[key]
            while bucket and len(out) < num:
                block_id = next(iter(bucket))
                del bucket[block_id]
                bucket_of[block_id] = -1
                if block_id in evictable:
                    out.append(block_id)
            if not bucket:
                del buckets[key]
                heapq.heappop(bucket_ids)
        return out

    def evicted(self, block_ids: list[int], entries: list[CachedBlock]) -> None:
        ghost, ids = self.ghost, np.array(block_ids, dtype=np.int64)
        ranks = self.rank[ids].tolist()
        for entry, rank in zip(entries, ranks):  # victims are parked blocks: ``known``
            ghost[entry.block_hash] = rank
        self.known[ids] = False
        while len(ghost) > self.ghost_limit:
            ghost.popitem(last=False)

    def check_invariants(self, evictable: OrderedDict[int, None]) -> None:
        held = [(b, key) for key, bucket in self.buckets.items() for b in bucket]
        if len(held) != len({b for b, _ in held}) or any(self.bucket_of[b] != key for b, key in held):
            raise InvariantViolationError("LRFU: a block is in two buckets, or not in the one bucket_of names")
        if sum(1 for b in self.bucket_of if b != -1) != len(held):
            raise InvariantViolationError("LRFU: bucket_of names a bucket for a block in none")
        missing = [b for b in evictable if self.bucket_of[b] == -1 or not self.known[b]]
        if missing:
            raise InvariantViolationError(f"LRFU: evictable blocks {missing[:8]} are in no bucket or have no rank")
        if sorted(self.bucket_ids) != sorted(self.buckets) or len(self.buckets) > self.max_buckets:
            raise InvariantViolationError("LRFU: the bucket heap and the buckets disagree")
        if len(self.ghost) > self.ghost_limit:
            raise InvariantViolationError(f"LRFU: {len(self.ghost)} remembered hashes, over {self.ghost_limit}")
