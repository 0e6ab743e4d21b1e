"""EventConsumer: a router's index built from the core's KV event batches (``core.kv_events``), for the stateful
test's invariant "the consumer's index equals the prefix cache's entries". The client's ``EventIndex`` does the
same from the wire; this one stays in the core's world (the core never imports kvpool_client)."""

from __future__ import annotations

from kvpool_server.core.block_hash import NONE_HASH
from kvpool_server.core.kv_events import AllBlocksCleared, BlockStored, EventBatch
from kvpool_server.core.prefix_cache import PrefixCache


class EventConsumer:
    """block hash -> (parent hash or None, token ids), as of batch ``seq``. Strict: a batch must follow the last
    (or be a snapshot), and a removed hash must be held."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self.seq = 0
        self.num_snapshots = 0

    def apply(self, batch: EventBatch) -> None:
        assert batch.snapshot or batch.seq == self.seq + 1, f"batch {batch.seq} after {self.seq}"
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                parent, size = event.parent_block_hash, event.block_size
                for i, block_hash in enumerate(event.block_hashes):  # a run of blocks: consecutive, chained
                    self.blocks[block_hash] = (parent, tuple(event.token_ids[i * size : (i + 1) * size]))
                    parent = block_hash
            else:
                for block_hash in event.block_hashes:
                    assert self.blocks.pop(block_hash, None) is not None, "BlockRemoved of a hash never stored"
        self.seq = batch.seq
        self.num_snapshots += batch.snapshot


def cache_index(cache: PrefixCache) -> dict[bytes, tuple[bytes | None, tuple[int, ...]]]:
    """The prefix cache's entries in the consumer's form."""
    return {e.block_hash: (None if e.parent_hash == NONE_HASH else e.parent_hash, tuple(e.token_ids.tolist()))
            for e in cache.entries.values()}
