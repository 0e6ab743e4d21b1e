"""KVEventLog: the prefix cache's changes as vLLM-style KV events, in numbered batches, for a router to follow.

Served by the ``SubscribeEvents`` RPC (``event_stream.py``). The events carry vLLM's kv_events fields
(``BlockStored{block_hashes, parent_block_hash, token_ids, block_size}``, ``BlockRemoved{block_hashes}``,
``AllBlocksCleared{}``); a batch carries the pool's ``epoch`` (a new one each start: sequence numbers restart) and
its sequence number.

A BlockStored carries a run of blocks, as vLLM's does: blocks sealed one after another that chain (each the
parent of the next; a sequence's blocks sealed by one call) and share one salt (a public prefix's blocks and the
tenant's blocks after them are two runs) are one event, their token ids concatenated::

    BlockStored(block_hashes=(h1, h2, h3), parent_block_hash=h0, token_ids=t1 + t2 + t3, block_size=16)
    = h1 (parent h0, tokens t1), h2 (parent h1, tokens t2), h3 (parent h2, tokens t3)

One event per run instead of one per block is what lets a subscriber follow a server that seals blocks by the
thousand a call (benchmarks/bench_events.py).

Bounded in bytes, not only in batches: one frontend sealing long prompts in a loop grew a server holding 10,000
batches from 72 MB to 3.36 GB. The log keeps an estimate of what each batch holds (``batch_bytes``) and drops the
oldest batches while the total is over ``max_bytes`` (default ``DEFAULT_EVENT_LOG_BYTES``, 64 MiB); the events
gathered during one call (``pending``) are bounded by the same ``max_bytes`` (``PendingEvents``). The estimate
counts each token id at 4 B (held as uint32: ``array('I')``), each hash at 32 B, and fixed overheads measured with
tracemalloc on CPython 3.11 and rounded up (``HASH_OVERHEAD`` etc. below); ``tests/core/test_kv_event_bytes.py``
checks that tracemalloc's growth stays under the bound.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterable
from itertools import islice
from typing import cast

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core import event_records
from kvpool_server.core.kv_event_types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvpool_server.core.prefix_cache import CachedBlock, PrefixCache

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventBatch", "KVEvent", "KVEventLog", "stored_runs"]

DEFAULT_EVENT_LOG_BYTES = 64 << 20  # the log's bound (published batches; and, apart, the pending events of a call)
TOKEN_BYTES = 4  # a token id, as a BlockStored holds it (uint32)
U32 = np.dtype("<u4")  # a cached block's token ids (the dtype object NumPy shares by every such array)
HASH_BYTES = 32  # a block hash (sha256)
# Measured with tracemalloc (CPython 3.11, 64-bit), rounded up: what a hash costs beyond its 32 bytes (its bytes
# object's header and its slot in a tuple: 41 + 8), what an event costs beyond its hashes and token ids (the
# object, its tuples, its token array's header: ~200), a batch beyond its events (the object, its events tuple,
# its deque slot: ~150), and a pending stored block beyond its hash and token ids (a CachedBlock, its parent
# hash, its NumPy token array's header, its list slot: ~310; often shared with the cache's entry while cached).
HASH_OVERHEAD = 56
EVENT_OVERHEAD = 224
BATCH_OVERHEAD = 160
PENDING_BLOCK_OVERHEAD = 320


# What the prefix cache records while a call runs: the entries it stored (made into BlockStored runs on publish)
# and BlockRemoved events; the host tier's BlockStored (medium "CPU"), one block each.
PendingEvent = CachedBlock | BlockRemoved | BlockStored


class EventsLost:
    """Marks, first in ``pending``, that a call's events outgrew the bound and were dropped: the batch they were
    to make is lost, so every subscriber must take a snapshot."""


EVENTS_LOST = EventsLost()


class PendingEvents(list[PendingEvent | EventsLost]):
    """The events of the call under way, as the prefix cache appends them, bounded by ``max_bytes`` (estimated as
    ``pending_bytes``): past it they are dropped and replaced by ``EVENTS_LOST`` (``lost``), and the rest of the
    call's events are gathered after it. A list, so that ``if log.pending`` stays the cheap test."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__()
        self.max_bytes: int = max_bytes
        self.num_bytes: int = 0
        self.lost: bool = False

    def append(self, item: PendingEvent | EventsLost) -> None:
        self.num_bytes += pending_bytes(item)
        if self.num_bytes > self.max_bytes:
            super().clear()
            self.num_bytes, self.lost = pending_bytes(item), True
            super().append(EVENTS_LOST)
        super().append(item)

    def extend(self, items: Iterable[PendingEvent | EventsLost]) -> None:
        """``append`` of each item, in order; a batch of stored blocks (a decode step's seals) in one step while it
        stays within the bound."""
        items = list(items)
        if all(item.__class__ is CachedBlock for item in items):
            size = stored_bytes(cast("list[CachedBlock]", items))
            if self.num_bytes + size <= self.max_bytes:
                self.num_bytes += size
                super().extend(items)
                return
        for item in items:
            self.append(item)

    def reset(self) -> None:
        super().clear()
        self.num_bytes, self.lost = 0, False


class KVEventLog:
    """Events gathered while a call runs (``pending``), published as one batch (``publish``) into a buffer of the
    last ``capacity`` batches that hold at most ``max_bytes`` (estimated: ``batch_bytes``); older ones are dropped
    (``num_dropped``). A subscriber resumes with ``since(from_seq)``; one that is too far behind (or new) starts
    from ``snapshot``: AllBlocksCleared, then a BlockStored per cached block, as of the last published batch.

    A call whose events outgrow ``max_bytes`` loses them (``PendingEvents``): its publish drops every buffered
    batch and uses up a sequence number with no batch, so that ``since`` sends every subscriber to a snapshot
    (each lost or dropped batch is counted in ``num_dropped``).

    The buffered batches rest packed (``event_records.pack``: no object the garbage collector walks, however many
    are buffered) and are unpacked for a subscriber that reads them, but for the newest, kept as published.

    Invariants: the buffered batches' sequence numbers are consecutive and the last is ``next_seq - 1`` (when any
    is buffered); ``num_bytes`` is the sum of their ``batch_bytes``, at most ``max_bytes``, and there are at most
    ``capacity`` of them; ``newest`` is the last of them as published (None when none is buffered).
    """

    def __init__(self, epoch: int, capacity: int = 10_000, max_bytes: int = DEFAULT_EVENT_LOG_BYTES) -> None:
        self.epoch: int = epoch
        self.capacity: int = capacity
        self.max_bytes: int = max_bytes
        # The buffered batches, packed (event_records.py: nothing in them for the garbage collector to walk) but
        # the newest, which ``newest`` also holds as it was published (what a subscriber keeping up reads).
        self.batches: deque[event_records.PackedBatch] = deque()
        self.newest: EventBatch | None = None
        self.batch_sizes: deque[int] = deque()  # batch_bytes of each of ``batches``
        self.num_bytes: int = 0
        self.pending: PendingEvents = PendingEvents(max_bytes)
        self.next_seq: int = 1
        self.num_dropped: int = 0

    def attach(self, cache: PrefixCache) -> None:
        """Record ``cache``'s stores and evictions into ``pending`` (which the cache only appends to)."""
        cache.events = cast("list[PendingEvent]", self.pending)

    def publish(self) -> EventBatch | None:
        """Close the pending events into the next batch (None when there are none)."""
        pending = self.pending
        if not pending:
            return None
        if pending.lost:  # the lost batch: every subscriber takes a snapshot
            self.num_dropped += len(self.batches) + 1
            self.batches.clear()
            self.batch_sizes.clear()
            self.num_bytes, self.newest = 0, None
            self.next_seq += 1
            del pending[0]  # EVENTS_LOST; what follows it is the rest of the call's events
            if not pending:
                pending.reset()
                return None
        batch = EventBatch(self.epoch, self.next_seq, stored_runs(pending))  # type: ignore[arg-type]
        size = batch_bytes(batch)
        self.batches.append(event_records.pack(batch))
        self.newest = batch
        self.batch_sizes.append(size)
        self.num_bytes += size
        while self.batches and (self.num_bytes > self.max_bytes or len(self.batches) > self.capacity):
            self.batches.popleft()
            self.num_bytes -= self.batch_sizes.popleft()
            self.num_dropped += 1
        if not self.batches:
            self.newest = None
        self.next_seq += 1
        pending.reset()  # the same list: the cache appends to it
        return batch

    def since(self, from_seq: int) -> list[EventBatch] | None:
        """The batches numbered ``from_seq`` and later, or None when some of them were dropped (take a snapshot)."""
        oldest = self.batches[0][1] if self.batches else self.next_seq
        if from_seq < oldest or from_seq > self.next_seq:
            return None
        newest = self.newest
        if newest is not None and from_seq >= newest.seq:  # a subscriber keeping up: nothing to unpack
            return [newest] if from_seq == newest.seq else []
        return [newest if newest is not None and b[1] == newest.seq else event_records.unpack(b)
                for b in islice(self.batches, from_seq - oldest, None)]

    def buffered_bytes(self, batch: EventBatch) -> int:
        """``batch_bytes(batch)`` of a batch just published: as counted when it is buffered."""
        return self.batch_sizes[-1] if self.newest is batch else batch_bytes(batch)

    def snapshot(self, cache: PrefixCache, kept: Iterable[BlockStored] = ()) -> EventBatch:
        """The cache's content as one batch, numbered as the last published batch (resume at its seq + 1).
        ``kept``: what a keeper of the cache's evictions holds beside it (a host tier's blocks the pool holds no
        copy of, medium "CPU": ``offload.HostTier.stored_events``)."""
        events = (AllBlocksCleared(), *stored_runs(cache.entries.values()), *kept)  # entries: in the order stored
        return EventBatch(self.epoch, self.next_seq - 1, events, snapshot=True)


def event_bytes(event: KVEvent) -> int:
    """The estimated bytes one event holds (module docstring)."""
    if isinstance(event, BlockStored):
        return (EVENT_OVERHEAD + len(event.block_hashes) * (HASH_BYTES + HASH_OVERHEAD)
                + len(event.token_ids) * TOKEN_BYTES + len(event.cache_extra_key) + len(event.salt))
    if isinstance(event, BlockRemoved):
        return EVENT_OVERHEAD + len(event.block_hashes) * (HASH_BYTES + HASH_OVERHEAD)
    return EVENT_OVERHEAD


def batch_bytes(batch: EventBatch) -> int:
    """The estimated bytes a buffered batch holds."""
    return BATCH_OVERHEAD + sum(map(event_bytes, batch.events))


def pending_bytes(item: PendingEvent | EventsLost) -> int:
    """The estimated bytes a pending entry holds: a stored block (its hash, parent hash and token ids are counted
    as its own, though the cache's entry often shares them) or a BlockRemoved."""
    if isinstance(item, CachedBlock):
        return (PENDING_BLOCK_OVERHEAD + 2 * (HASH_BYTES + HASH_OVERHEAD) + item.token_ids.size * TOKEN_BYTES
                + len(item.extra))
    return event_bytes(item) if isinstance(item, (BlockRemoved, BlockStored)) else 0


def stored_bytes(entries: list[CachedBlock]) -> int:
    """``sum(pending_bytes(e) for e in entries)``, for a batch of stored blocks."""
    return (len(entries) * (PENDING_BLOCK_OVERHEAD + 2 * (HASH_BYTES + HASH_OVERHEAD))
            + sum([e.token_ids.size * TOKEN_BYTES + len(e.extra) for e in entries]))


def stored_runs(items: Iterable[PendingEvent]) -> tuple[KVEvent, ...]:
    """``items`` in order, each run of consecutive stored entries that chain (with one extra key and one salt)
    made one BlockStored."""
    events: list[KVEvent] = []
    run: list[CachedBlock] = []
    for item in items:
        if isinstance(item, CachedBlock):
            if run:
                last = run[-1]
                if item.parent_hash != last.block_hash or item.extra != last.extra or item.salt != last.salt:
                    events.append(_stored(run))
                    run = [item]
                    continue
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
    if len(run) == 1:  # a decode step's seal: one block a sequence
        hashes: tuple[bytes, ...] = (first.block_hash,)
        tokens = first.token_ids
    else:
        hashes = tuple([e.block_hash for e in run])
        tokens = np.concatenate([e.token_ids for e in run])
    token_ids = array("I", (tokens if tokens.dtype is U32 else tokens.astype(U32)).tobytes())
    return BlockStored(hashes, parent, token_ids, first.token_ids.size, first.extra, first.salt)
