"""The host tier's invariant checks (``HostTier.check_invariants``; the invariants are written in ``HostTier``'s
docstring): a walk of every slot, entry and in-flight write-back -- for tests and ``--check-invariants``, never a
serving call's path."""

from __future__ import annotations

from itertools import islice
from typing import Any

from kvpool_server.core.block_hash import block_hash
from kvpool_server.core.errors import InvariantViolationError


def check_host_tier(tier: Any) -> None:  # a HostTier (not imported: host_tier.py imports this module)
    committed = set(tier.slot_of_hash.values())
    pending = set(tier.pending_hashes.values())
    free = set(tier.free)
    if len(free) != len(tier.free) or free & committed or free & pending or committed & pending:
        raise InvariantViolationError("a host slot is in two of free, pending and committed")
    if len(free) + len(committed) + len(pending) != tier.num_ready or (free and max(free) >= tier.num_ready):
        raise InvariantViolationError("a ready host slot is neither free, pending nor committed")
    if set(tier.entries) != committed | pending:
        raise InvariantViolationError("the host tier's entries are not exactly its pending and committed slots")
    for h, slot in [*tier.slot_of_hash.items(), *tier.pending_hashes.items()]:
        entry = tier.entries[slot]
        if entry.block_hash != h:
            raise InvariantViolationError(f"host slot {slot} is indexed under another hash than its entry's")
        if block_hash(entry.parent_hash, entry.token_ids, entry.salt, entry.extra) != h:
            raise InvariantViolationError(f"host slot {slot}'s hash does not match its content chain")
    if set(tier.lru) & tier.pinned or set(tier.lru) | tier.pinned != committed:
        raise InvariantViolationError("the host LRU and the pinned slots do not split the committed slots")
    restoring = [slot for slots in tier.restoring.values() for slot in slots]
    if len(restoring) != len(set(restoring)) or set(restoring) != tier.pinned:
        raise InvariantViolationError("the pinned slots are not exactly the in-flight restores', each once")
    if not set(tier.restoring) <= set(tier.manager.held_outside):
        raise InvariantViolationError("an in-flight restore holds no pool blocks (held_outside)")
    if set(tier.inflight.values()) != pending:
        raise InvariantViolationError("between calls, the pending slots are not exactly the in-flight write-backs'")
    if not tier.torn <= pending:
        raise InvariantViolationError("a torn slot is not an in-flight write-back's")
    in_pool = tier.cache.block_of_hash
    for block_id, slot in tier.inflight.items():
        if slot not in tier.torn and in_pool.get(tier.entries[slot].block_hash) != block_id:
            raise InvariantViolationError(f"in-flight write-back of block {block_id} no longer cached in the pool")
    if list(dict.__iter__(tier.cache.evictable)) != list(tier.cache.evictable):
        raise InvariantViolationError("the pool's evictable LRU was reordered: its dict order is not its order")
    skip = tier.scan_start(tier.cache.evictable)  # (normalises the hint only)
    hash_of = {b: h for h, b in in_pool.items()}
    for block_id in islice(tier.cache.evictable, skip):
        h = hash_of[block_id]
        if block_id not in tier.inflight and h not in tier.slot_of_hash and h not in tier.pending_hashes:
            raise InvariantViolationError(f"block {block_id} in the write-back's skipped run is not in the tier")
