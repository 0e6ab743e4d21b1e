"""The KV events' records, vLLM's kv_events fields (``kv_events.py`` gathers them into batches): below the prefix
cache, which records evictions as BlockRemoved."""

from __future__ import annotations

from array import array
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]  # a run: each the parent of the next
    parent_block_hash: bytes | None  # the first one's parent; None: the first block of a sequence
    token_ids: array[int]  # every block's, concatenated: block_size per hash; array('I'), 4 bytes each
    block_size: int
    cache_extra_key: bytes = b""  # the sequence's extra key, in every block's hash
    salt: bytes = b""  # every block's salt (a run has one): its tenant's name, or PUBLIC_SALT (block_hash.py)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
