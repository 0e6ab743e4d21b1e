"""KVEventLog: the prefix cache's changes as vLLM-style KV events, in numbered batches, for a router to follow.

Served by the ``SubscribeEvents`` RPC (``event_stream.py``). The events carry vLLM's kv_events fields (``BlockStored{block_hashes, parent_block_hash, token_ids, block_size}``,
``BlockRemoved{block_hashes}``, ``AllBlocksCleared{}``); a batch carries the pool's ``epoch`` (a new one each start:
sequence numbers restart) and its sequence number.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.prefix_cache import CachedBlock, PrefixCache


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None  # None: the first block of a sequence
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    epoch: int
    seq: int  # 1, 2, ... within an epoch; a snapshot carries the seq of the last batch it includes
    events: tuple[KVEvent, ...]
    snapshot: bool = False


class KVEventLog:
    """Events gathered while a call runs (``pending``), published as one batch (``publish``) into a bounded buffer
    of the last ``capacity`` batches; older ones are dropped (``num_dropped``). A subscriber resumes with
    ``since(from_seq)``; one that is too far behind (or new) starts from ``snapshot``: AllBlocksCleared, then a
    BlockStored per cached block, as of the last published batch.

    Invariants: batch sequence numbers are consecutive; ``next_seq - 1`` is the last published one.
    """

    def __init__(self, epoch: int, capacity: int = 10_000) -> None:
        self.epoch: int = epoch
        self.capacity: int = capacity
        self.batches: deque[EventBatch] = deque(maxlen=capacity)
        self.pending: list[KVEvent] = []
        self.next_seq: int = 1
        self.num_dropped: int = 0

    def attach(self, cache: PrefixCache) -> None:
        """Record ``cache``'s stores and evictions into ``pending``."""
        cache.events = self.pending

    def publish(self) -> EventBatch | None:
        """Close the pending events into the next batch (None when there are none)."""
        if not self.pending:
            return None
        batch = EventBatch(self.epoch, self.next_seq, tuple(self.pending))
        if len(self.batches) == self.capacity:
            self.num_dropped += 1
        self.batches.append(batch)
        self.next_seq += 1
        self.pending.clear()  # the same list: the cache appends to it
        return batch

    def since(self, from_seq: int) -> list[EventBatch] | None:
        """The batches numbered ``from_seq`` and later, or None when some of them were dropped (take a snapshot)."""
        oldest = self.batches[0].seq if self.batches else self.next_seq
        if from_seq < oldest or from_seq > self.next_seq:
            return None
        return [b for b in self.batches if b.seq >= from_seq]

    def snapshot(self, cache: PrefixCache) -> EventBatch:
        """The cache's content as one batch, numbered as the last published batch (resume at its seq + 1)."""
        events: list[KVEvent] = [AllBlocksCleared()]
        events += [stored_event(entry) for entry in cache.entries.values()]
        return EventBatch(self.epoch, self.next_seq - 1, tuple(events), snapshot=True)


def stored_event(entry: CachedBlock) -> BlockStored:
    parent = None if entry.parent_hash == NONE_HASH else entry.parent_hash
    return BlockStored((entry.block_hash,), parent, tuple(entry.token_ids.tolist()), int(entry.token_ids.size))
