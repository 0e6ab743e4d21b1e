"""The KV event log's buffered batches at rest: plain tuples of bytes and ints, which the garbage collector does
not walk (``pack``), made back into the batch they were (``unpack``) when a subscriber reads them."""

from __future__ import annotations

from array import array

from kvpool_server.core.kv_event_types import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

# A buffered batch of KVEventLog holds one object per event: a decode step's batch a BlockStored of each sealed
# block, each with an ``array('I')`` of its tokens -- all three kinds of object tracked by the collector, so that
# a log of 10,000 batches made every full collection walk ~250 k objects (benchmarks/bench_gc_pause.py). Packed,
# a batch is an exact tuple of exact tuples of bytes, ints, str and None: the collector untracks each at the
# first young collection it survives, and none ever reaches the old generation.
#
#   batch:        (epoch, seq, snapshot, events)
#   BlockStored:  (STORED, block_hashes, parent_block_hash, token bytes, block_size, cache_extra_key, salt, medium)
#   BlockRemoved: (REMOVED, block_hashes, medium)
#   AllBlocksCleared: (CLEARED,)
STORED, REMOVED, CLEARED = 0, 1, 2
PackedBatch = tuple  # (epoch, seq, snapshot, events), as above


def pack(batch: EventBatch) -> PackedBatch:
    """``batch`` as plain tuples (the module's comment); ``unpack`` makes an equal batch of it."""
    events: list[tuple] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append((STORED, e.block_hashes, e.parent_block_hash, e.token_ids.tobytes(), e.block_size,
                           e.cache_extra_key, e.salt, e.medium))
        elif isinstance(e, BlockRemoved):
            events.append((REMOVED, e.block_hashes, e.medium))
        else:
            events.append((CLEARED,))
    return (batch.epoch, batch.seq, batch.snapshot, tuple(events))


def unpack(packed: PackedBatch) -> EventBatch:
    epoch, seq, snapshot, packed_events = packed
    events: list[KVEvent] = []
    for p in packed_events:
        kind = p[0]
        if kind == STORED:
            events.append(BlockStored(p[1], p[2], array("I", p[3]), p[4], p[5], p[6], p[7]))
        elif kind == REMOVED:
            events.append(BlockRemoved(p[1], p[2]))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(epoch, seq, tuple(events), snapshot)
