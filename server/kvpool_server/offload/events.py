"""The host tier's KV events: its medium, and the one-block BlockStored of a committed host slot."""

from __future__ import annotations

from array import array

import numpy as np

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.kv_event_types import BlockStored, CachedBlock

HOST_MEDIUM = "CPU"  # the events' medium of the host tier


def host_stored(entry: CachedBlock) -> BlockStored:
    """A one-block BlockStored of the host tier."""
    token_ids = array("I")
    token_ids.frombytes(entry.token_ids.astype(np.uint32, copy=False).tobytes())
    parent = None if entry.parent_hash == NONE_HASH else entry.parent_hash
    return BlockStored((entry.block_hash,), parent, token_ids, int(entry.token_ids.size), entry.extra,
                       salt=entry.salt, medium=HOST_MEDIUM)
