"""The host tier's KV events: its medium, the one-block BlockStored of a committed host slot, and the BlockStored
runs of a batch of them (a write-back's chunk: one event a run of blocks that chain, as the pool's own)."""

from __future__ import annotations

from array import array

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.kv_event_types import BlockStored, CachedBlock
from kvpool_server.core.kv_events import stored_runs

HOST_MEDIUM = "CPU"  # the events' medium of the host tier


def host_stored(entry: CachedBlock) -> BlockStored:
    """A one-block BlockStored of the host tier."""
    token_ids = array("I")
    token_ids.frombytes(entry.token_ids.astype(np.uint32, copy=False).tobytes())
    parent = None if entry.parent_hash == NONE_HASH else entry.parent_hash
    return BlockStored((entry.block_hash,), parent, token_ids, int(entry.token_ids.size), entry.extra,
                       salt=entry.salt, medium=HOST_MEDIUM)


def host_stored_runs(entries: list[CachedBlock]) -> list[BlockStored]:
    """The BlockStored events of host slots holding ``entries``, given in the pool's eviction order: a sequence's
    blocks are parked tail first (its chain reversed), so they are read from the last to the first and each run that
    chains (``kv_events.stored_runs``) is one event, parent first, medium "CPU" -- a write-back's chunk of 8 blocks
    is one or two events to append, publish and buffer, not 8."""
    return [event._replace(medium=HOST_MEDIUM) for event in stored_runs(entries[::-1])]  # type: ignore[union-attr]
