"""The KV events' records, vLLM's kv_events fields (``kv_events.py`` gathers them into batches): below the prefix
cache, which records evictions as BlockRemoved."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class CachedBlock(NamedTuple):
    """What a cached block's hash was computed from, kept so that the hash can be checked against its content (the
    prefix cache's and the host tier's entries; a pending BlockStored until its batch is published)."""

    block_hash: bytes
    parent_hash: bytes
    token_ids: np.ndarray  # uint32 [block_size]
    salt: bytes  # the tenant's name, or PUBLIC_SALT: the block is public (may be held by several tenants)
    extra: bytes = b""  # the sequence's extra key


class BlockStored(NamedTuple):  # immutable like the others; a NamedTuple: made 3x cheaper than a frozen dataclass
    block_hashes: tuple[bytes, ...]  # a run: each the parent of the next
    parent_block_hash: bytes | None  # the first one's parent; None: the first block of a sequence
    token_ids: array[int]  # every block's, concatenated: block_size per hash; array('I'), 4 bytes each
    block_size: int
    cache_extra_key: bytes = b""  # the sequence's extra key, in every block's hash
    salt: bytes = b""  # every block's salt (a run has one): its tenant's name, or PUBLIC_SALT (block_hash.py)
    medium: str = ""  # "CPU": the host tier; "": the pool's own medium (the event feed's)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]
    medium: str = ""  # "CPU": the last copy was the host tier's; "": the pool's own medium (the event feed's)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    epoch: int
    seq: int  # 1, 2, ... within an epoch; a snapshot carries the seq of the last batch it includes
    events: tuple[KVEvent, ...]
    snapshot: bool = False
