"""KVEventLog: the prefix cache's changes as vLLM-style KV events, in numbered batches, for a router to follow.

Served by the ``SubscribeEvents`` RPC (``event_stream.py``). The events carry vLLM's kv_events fields
(``BlockStored{block_hashes, parent_block_hash, token_ids, block_size}``, ``BlockRemoved{block_hashes}``,
``AllBlocksCleared{}``); a batch carries the pool's ``epoch`` (a new one each start: sequence numbers restart) and
its sequence number.

A BlockStored carries a run of blocks, as vLLM's does: blocks sealed one after another that chain (each the
parent of the next; a sequence's blocks sealed by one call) are one event, their token ids concatenated::

    BlockStored(block_hashes=(h1, h2, h3), parent_block_hash=h0, token_ids=t1 + t2 + t3, block_size=16)
    = h1 (parent h0, tokens t1), h2 (parent h1, tokens t2), h3 (parent h2, tokens t3)

One event per run instead of one per block is what lets a subscriber follow a server that seals blocks by the
thousand a call (benchmarks/bench_events.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.prefix_cache import CachedBlock, PrefixCache


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]  # a run: each the parent of the next
    parent_block_hash: bytes | None  # the first one's parent; None: the first block of a sequence
    token_ids: tuple[int, ...]  # every block's, concatenated: block_size per hash
    block_size: int
    cache_extra_key: bytes = b""  # the sequence's extra key, in every block's hash


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
# What the prefix cache records while a call runs: the entries it stored (made into BlockStored runs on publish)
# and BlockRemoved events.
PendingEvent = CachedBlock | BlockRemoved


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
        self.pending: list[PendingEvent] = []
        self.next_seq: int = 1
        self.num_dropped: int = 0

    def attach(self, cache: PrefixCache) -> None:
        """Record ``cache``'s stores and evictions into ``pending``."""
        cache.events = self.pending

    def publish(self) -> EventBatch | None:
        """Close the pending events into the next batch (None when there are none)."""
        if not self.pending:
            return None
        batch = EventBatch(self.epoch, self.next_seq, stored_runs(self.pending))
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
        events = (AllBlocksCleared(), *stored_runs(cache.entries.values()))  # entries: in the order stored
        return EventBatch(self.epoch, self.next_seq - 1, events, snapshot=True)


def stored_runs(items: Iterable[PendingEvent]) -> tuple[KVEvent, ...]:
    """``items`` in order, each run of consecutive stored entries that chain made one BlockStored."""
    events: list[KVEvent] = []
    run: list[CachedBlock] = []
    for item in items:
        if isinstance(item, CachedBlock):
            if run and (item.parent_hash != run[-1].block_hash or item.extra != run[-1].extra):
                events.append(_stored(run))
                run = []
            run.append(item)
        else:
            if run:
                events.append(_stored(run))
                run = []
            events.append(item)
    if run:
        events.append(_stored(run))
    return tuple(events)


def _stored(run: list[CachedBlock]) -> BlockStored:
    first = run[0]
    parent = None if first.parent_hash == NONE_HASH else first.parent_hash
    tokens = np.concatenate([e.token_ids for e in run]) if len(run) > 1 else first.token_ids
    return BlockStored(tuple(e.block_hash for e in run), parent, tuple(tokens.tolist()), int(first.token_ids.size),
                       first.extra)
