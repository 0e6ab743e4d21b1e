"""The host tier's write-back: the pool's evictable blocks next in line copied ahead, ``plan`` then ``finish``.

    pairs = plan(tier, cache.evictable, cache.entries, max_blocks)  # (pool block, host slot): slots taken, pending
    ... the driver copies the blocks out, off any call's path (its background thread) ...
    finish(tier, pairs, ok)                                         # ok: the slots are committed; else aborted

The blocks stay in the pool, matchable and evictable, while their copy runs; ``HostTier.inflight`` says a copy
reads them, so that an eviction of one makes the driver wait for it (``StorePlan.wait``) or tears its slot
(``HostTier.torn``, with offload on eviction off) before anything writes into it; an eviction then finds their hash
in the tier and costs no copy. The state (and its invariants) is the tier's: see ``HostTier``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from itertools import islice

import numpy as np

from kvpool_server.core.kv_event_types import BlockRemoved, BlockStored, CachedBlock
from kvpool_server.offload.events import HOST_MEDIUM
from kvpool_server.offload.host_tier import HostTier


def plan(tier: HostTier, evictable: OrderedDict[int, None], entries: Mapping[int, CachedBlock],
         max_blocks: int, max_scan: int | None = None) -> np.ndarray:
    """Copy ahead (off any call's path): up to ``max_blocks`` of the pool's evictable blocks next in line for
    eviction (the LRU's oldest, scanning at most ``max_scan``, default ``8 * max_blocks``) whose hash no slot
    holds get a slot (free, else the host LRU's oldest). They stay in the pool, matchable and evictable;
    ``inflight`` says a copy reads them, so that an eviction of one makes the driver wait for it
    (``StorePlan.wait``) or tears its slot before anything writes into it. Returns the pairs (pool block, host slot)
    to copy, in eviction order; ``finish`` settles them."""
    pairs: list[int] = []  # flat: block, slot, block, slot, ... (one array made of it at the end)
    dropped: list[bytes] = []
    inflight, slot_of_hash, pending, tier_entries = tier.inflight, tier.slot_of_hash, tier.pending_hashes, tier.entries
    free = tier.free
    hash_of = getattr(entries, "hash_of", None) or (lambda block_id: entries[block_id].block_hash)  # BlockRecords'
    start, blocks = tier.scan_from(evictable)
    scanned, mark = 0, tier.scan_mark  # the run of blocks held or planned from ``start`` on
    wanted = 2 * max_blocks
    for block_id in islice(blocks, max(0, (8 * max_blocks if max_scan is None else max_scan) - start)):
        if len(pairs) == wanted:
            break
        h = hash_of(block_id)
        if not (block_id in inflight or h in slot_of_hash or h in pending):
            slot = free.pop() if free else tier.take_slot(dropped)
            if slot is None:
                break
            tier_entries.copy_from(slot, entries, block_id)
            pending[h] = slot
            inflight[block_id] = slot
            pairs += block_id, slot
        scanned, mark = scanned + 1, block_id
    if tier.scan_skip == start:  # no drop of a pool-held hash meanwhile (``take_slot``): the hint holds
        tier.scan_skip, tier.scan_mark = start + scanned, mark
    if dropped and tier.cache.events is not None:
        tier.cache.events.append(BlockRemoved(tuple(dropped), HOST_MEDIUM))
    return np.array(pairs, dtype=np.int32).reshape(-1, 2)


def finish(tier: HostTier, pairs: np.ndarray, ok: bool, stored: list[BlockStored] | None = None,
           hashes: list[bytes] | None = None) -> None:
    """The write-back of ``pairs`` completed (``ok``: its slots are committed) or failed (aborted).
    ``stored``: the slots' BlockStored events built ahead (``host_stored_runs`` of their entries), if any;
    ``hashes``: their hashes, read ahead (``HostTier.commit``)."""
    inflight, torn_slots, torn = tier.inflight, tier.torn, []
    for block_id in pairs[:, 0].tolist():
        del inflight[block_id]
    slots = pairs[:, 1].tolist()
    if torn_slots and not torn_slots.isdisjoint(slots):
        torn = [slot for slot in slots if slot in torn_slots]
        slots = [slot for slot in slots if slot not in torn_slots]
    if torn:
        torn_slots.difference_update(torn)
        tier.num_torn += len(torn)
        tier.abort(torn, failed=False)  # their block was evicted while the copy read it: the bytes may be torn
        stored = hashes = None  # the events built ahead name the torn blocks too: the commit builds its own
    if ok:
        tier.commit(slots, stored, hashes)
        tier.num_written_back += len(slots)
    else:
        tier.abort(slots)
