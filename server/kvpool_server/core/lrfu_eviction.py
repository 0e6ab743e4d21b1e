"""LrfuEviction: the prefix cache's evictable blocks ranked by their decayed reuse count (LRFU), with a bounded
memory of evicted blocks' counts."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice, repeat
from operator import attrgetter

import numpy as np

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.kv_event_types import CachedBlock

# A use counts half as much after this many tokens' worth of blocks parked since (the replay's choice on the
# conversation trace: docs/prefix-caching.md, "Eviction policy").
DEFAULT_HALF_LIFE_TOKENS = 12 << 20
DEFAULT_GHOST_FACTOR = 4  # evicted blocks remembered: this many times the pool's blocks
RANK_QUANTA = 16  # rank buckets a half-life (a use more is 16 buckets up)
SLACK = 1024
SMALL = 32  # at most this many blocks a call: a Python loop (NumPy's per-call cost is more)

_hash_of = attrgetter("block_hash")


class LrfuEviction:
    """Evicts the block of least combined recency-frequency (Lee et al.'s LRFU): each use of a block -- the end of
    a hold, when it is parked -- adds 1 to its count, and counts halve every ``half_life_tokens`` of blocks parked
    (the clock ticks one per block parked). A block reused by many requests over the last half-lives (a shared
    system prompt, a conversation that keeps coming back) outranks one used once more recently (the tail of a
    one-off prompt), which LRU would keep instead. Counts of evicted blocks are remembered by hash (``ghost``, the
    oldest forgotten first): a block recomputed after its eviction resumes its count, so the second use of a
    long-unseen prefix counts as one.

    A block's rank is ``log2(count) + decay * clock`` at its last use: the log of its count carried to a common
    time, so ranks compare at any later time and never change while a block waits. Blocks wait in buckets of
    1/RANK_QUANTA of a rank unit (``buckets``: key -> [block ids, their stamps, the index of the first not
    consumed], in park order; ``bucket_ids``, a min-heap of the keys); victims come from the lowest bucket, first
    parked first (a sequence's tail before its head, as under LRU). Each park gives the block a new ``stamp``; an
    entry is live iff its stamp is the block's current one, and ``unparked`` (the block taken back into use) or a
    later park makes it stale: skipped (in bulk, by NumPy) when reached, dropped when they pile up (``_compact``).

    Invariants (``check_invariants``): every evictable block has exactly one live entry, and nothing else has one;
    ``num_entries`` counts the entries not consumed, live and stale, at most ``max_entries``; ``bucket_ids``
    holds every bucket's key, at most ``max_buckets`` of them; the ghost holds at most ``ghost_limit`` hashes
    (memory: about 100 bytes a remembered hash; 5 times the pool's blocks at most).
    """

    name = "lrfu"

    def __init__(self, num_blocks: int, block_size: int, half_life_tokens: int = DEFAULT_HALF_LIFE_TOKENS,
                 ghost_factor: int = DEFAULT_GHOST_FACTOR) -> None:
        self.decay: float = block_size / half_life_tokens  # half-lives per block parked
        self.clock: int = 0  # blocks parked so far (also the next stamp)
        self.rank: np.ndarray = np.zeros(num_blocks)  # log2(count) + decay * clock, at the block's last use
        self.known: np.ndarray = np.zeros(num_blocks, dtype=bool)  # ``rank`` is of the block's current content
        self.stamp: np.ndarray = np.full(num_blocks, -1, dtype=np.int64)  # of its live entry (-1: none)
        self.buckets: dict[int, tuple[list[int], list[int], list[int]]] = {}
        self.bucket_ids: list[int] = []  # heap
        self.num_entries: int = 0
        self.max_entries: int = 2 * num_blocks + SLACK  # then compacted
        self.max_buckets: int = num_blocks + SLACK  # a bucket holds a live entry, or is compacted away
        # Evicted hash -> its rank, oldest first: a dict (its pops cost less than an OrderedDict's), cut back in
        # one pass to ``ghost_factor * num_blocks`` once it holds ``ghost_limit`` (a fifth more).
        self.ghost: dict[bytes, float] = {}
        self.ghost_keep: int = ghost_factor * num_blocks
        self.ghost_limit: int = self.ghost_keep + self.ghost_keep // 4 + SLACK

    def parked(self, ids: np.ndarray, entries: Mapping[int, CachedBlock], evictable: OrderedDict[int, None]) -> None:
        n = ids.size
        if n == 0:
            return
        now, stamp0, block_ids = self.decay * self.clock, self.clock, ids.tolist()
        known = self.known[ids]
        past = np.where(known, self.rank[ids], -np.inf)
        if not known.all():  # first parked since sealed: the ghost may remember the hash
            unknown = np.flatnonzero(~known)
            hashes = list(map(_hash_of, map(entries.__getitem__, ids[unknown].tolist())))
            if not self.ghost.keys().isdisjoint(hashes):
                past[unknown] = list(map(self.ghost.pop, hashes, repeat(-np.inf)))
        rank = np.log2(1.0 + np.exp2(past - now)) + now  # one use more, decayed to now
        self.known[ids], self.rank[ids] = True, rank
        self.stamp[ids] = np.arange(stamp0, stamp0 + n)
        keys = (rank * RANK_QUANTA).astype(np.int64)
        first = int(keys[0])
        if (keys == first).all():  # the common case: a prompt's blocks, used as often
            blocks, stamps, _ = self._bucket(first)
            blocks.extend(block_ids)
            stamps.extend(range(stamp0, stamp0 + n))
        else:
            order = np.argsort(keys, kind="stable")
            sorted_keys, sorted_ids, sorted_stamps = keys[order], ids[order].tolist(), (order + stamp0).tolist()
            starts = np.flatnonzero(np.diff(sorted_keys, prepend=sorted_keys[0] - 1)).tolist() + [n]
            for a, b in zip(starts, starts[1:]):
                blocks, stamps, _ = self._bucket(int(sorted_keys[a]))
                blocks.extend(sorted_ids[a:b])
                stamps.extend(sorted_stamps[a:b])
        self.num_entries += n
        self.clock += n
        if self.num_entries > self.max_entries or len(self.buckets) > self.max_buckets:
            self._compact()

    def unparked(self, block_ids: np.ndarray) -> None:
        """``block_ids`` were taken back into use (a prefix match): their entries are stale."""
        self.stamp[block_ids] = -1

    def _bucket(self, key: int) -> tuple[list[int], list[int], list[int]]:
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = ([], [], [0])
            heapq.heappush(self.bucket_ids, key)
        return bucket

    def _live(self, blocks: list[int], stamps: list[int]) -> np.ndarray:
        return self.stamp[np.array(blocks, dtype=np.int64)] == np.array(stamps, dtype=np.int64)

    def _compact(self) -> None:
        """Drop the consumed and stale entries and the buckets left empty."""
        kept: dict[int, tuple[list[int], list[int], list[int]]] = {}
        for key, (blocks, stamps, head) in self.buckets.items():
            blocks, stamps = blocks[head[0]:], stamps[head[0]:]
            live: list[int] = np.flatnonzero(self._live(blocks, stamps)).tolist() if blocks else []
            if live:
                kept[key] = ([blocks[i] for i in live], [stamps[i] for i in live], [0])
        self.buckets = kept
        self.bucket_ids = list(kept)
        heapq.heapify(self.bucket_ids)
        self.num_entries = sum(len(blocks) for blocks, _, _ in kept.values())

    def victims(self, evictable: OrderedDict[int, None], num: int) -> list[int]:
        out: list[int] = []
        while len(out) < num:
            if not self.bucket_ids:
                raise InvariantViolationError(f"LRFU: {num - len(out)} evictable blocks have no live entry")
            key = self.bucket_ids[0]
            blocks, stamps, head = self.buckets[key]
            start = head[0]
            stop = min(len(blocks), start + 2 * (num - len(out)) + 8)
            chunk, need = blocks[start:stop], num - len(out)
            if need <= SMALL:  # a decode step's few: one by one costs less than NumPy's calls
                stamp, used = self.stamp, 0
                for block_id, s in zip(chunk, stamps[start:stop]):
                    used += 1
                    if stamp.item(block_id) == s:
                        out.append(block_id)
                        if len(out) == num:
                            break
            else:
                live = np.flatnonzero(self._live(chunk, stamps[start:stop]))
                take, used = (live[:need], int(live[need - 1]) + 1) if live.size >= need else (live, len(chunk))
                out.extend(chunk[i] for i in take.tolist())
            head[0] = start + used
            self.num_entries -= used
            if head[0] == len(blocks):
                del self.buckets[key]
                heapq.heappop(self.bucket_ids)
            elif head[0] > 4096 and head[0] * 2 > len(blocks):
                del blocks[: head[0]], stamps[: head[0]]
                head[0] = 0
        if num <= SMALL:
            for block_id in out:
                self.stamp[block_id] = -1
        else:
            self.stamp[np.array(out, dtype=np.int64)] = -1
        return out

    def evicted(self, block_ids: list[int], hashes: list[bytes]) -> None:
        ghost = self.ghost
        if len(block_ids) <= SMALL:
            rank, known = self.rank, self.known
            for block_id, block_hash in zip(block_ids, hashes):
                ghost[block_hash] = rank.item(block_id)
                known[block_id] = False
        else:
            ids = np.array(block_ids, dtype=np.int64)
            ghost.update(zip(hashes, self.rank[ids].tolist()))  # victims are parked: ``known``
            self.known[ids] = False
        if len(ghost) > self.ghost_limit:  # the oldest go (a dict keeps insertion order)
            self.ghost = dict(islice(ghost.items(), len(ghost) - self.ghost_keep, None))

    def check_invariants(self, evictable: OrderedDict[int, None]) -> None:
        live: list[int] = []
        for blocks, stamps, head in self.buckets.values():
            rest = blocks[head[0]:]
            if rest:
                live += [rest[i] for i in np.flatnonzero(self._live(rest, stamps[head[0]:])).tolist()]
        if len(live) != len(set(live)) or set(live) != set(np.flatnonzero(self.stamp != -1).tolist()):
            raise InvariantViolationError("LRFU: a block has two live entries, or a stamp with no entry")
        missing = [b for b in evictable if self.stamp.item(b) == -1 or not self.known.item(b)]
        if missing or len(live) != len(evictable):
            raise InvariantViolationError(f"LRFU: evictable blocks {missing[:8]} have no live entry or rank, or "
                                          f"{len(live)} live entries for {len(evictable)} evictable blocks")
        counted = sum(len(blocks) - head[0] for blocks, _, head in self.buckets.values())
        if self.num_entries != counted or self.num_entries > self.max_entries:
            raise InvariantViolationError(f"LRFU: {self.num_entries} entries counted, {counted} held (max "
                                          f"{self.max_entries})")
        if sorted(self.bucket_ids) != sorted(self.buckets) or len(self.buckets) > self.max_buckets:
            raise InvariantViolationError("LRFU: the bucket heap and the buckets disagree")
        if len(self.ghost) > self.ghost_limit:
            raise InvariantViolationError(f"LRFU: {len(self.ghost)} remembered hashes, over {self.ghost_limit}")
