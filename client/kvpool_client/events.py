"""EventIndex: a router's view of the server's prefix cache, kept by applying SubscribeEvents batches.

    index = EventIndex()
    for batch in stub.SubscribeEvents(pb.SubscribeEventsRequest()):   # or EventFollower (event_follower.py)
        index.apply(batch)
    index.blocks[h]            # IndexedBlock(parent_hash, token_ids, block_size, cache_extra_key, medium) of each h
    index.from_seq             # where to resume after a disconnect: SubscribeEventsRequest(from_seq=index.from_seq)

Every batch carries the server's ``epoch`` (new at every start) and a ``seq`` (1, 2, ... within the epoch). The
index accepts a batch that follows the last one it applied (same epoch, ``seq + 1``), any snapshot (which replaces
the index: it opens with AllBlocksCleared), and ignores a batch it already applied (delivery is at least once). A
batch it cannot apply without losing changes -- a seq gap, or a new epoch that is not a snapshot (the server
restarted and the resume point means nothing there) -- raises ``EventGapError`` and changes nothing; the caller
resubscribes without ``from_seq`` (``index.from_seq`` is None after ``resync()``) and gets a snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.errors import KVPoolClientError


class EventGapError(KVPoolClientError):
    """A batch that does not follow the ones applied (a seq gap, or a new epoch without a snapshot): the index
    may have missed changes. Resubscribe for a snapshot (``EventIndex.resync()``, then no ``from_seq``)."""


class IndexedBlock(NamedTuple):
    parent_hash: bytes  # b"" for a sequence's first block
    token_ids: tuple[int, ...]
    block_size: int
    cache_extra_key: bytes = b""  # the sequence's extra key (LoRA, multimodal), part of the hash
    medium: str = ""  # "GPU" or "CPU": where the block lives


@dataclass
class EventCounts:
    num_batches: int = 0  # batches applied (snapshots included)
    num_snapshots: int = 0
    num_blocks_stored: int = 0  # hashes in BlockStored events (snapshots' included)
    num_blocks_removed: int = 0  # hashes in BlockRemoved events
    num_duplicates: int = 0  # batches skipped: already applied (at-least-once delivery)
    num_unknown_removed: int = 0  # BlockRemoved hashes the index did not hold

    @property
    def num_block_events(self) -> int:
        """One per block hash in a BlockStored or BlockRemoved."""
        return self.num_blocks_stored + self.num_blocks_removed


class EventIndex:
    """block hash -> (parent hash, token ids, block size) of every block the server has cached, as of batch
    ``(epoch, last_seq)``.

    A BlockStored may carry a run of consecutive blocks of one sequence (vLLM's form): ``block_hashes[i]``'s
    tokens are ``token_ids[i * block_size : (i + 1) * block_size]`` and its parent is ``block_hashes[i - 1]``
    (``parent_block_hash`` for the first).

    Invariant: ``epoch`` and ``last_seq`` are None together, until the first snapshot is applied; from then on the
    index is the server's index as of batch ``last_seq`` of ``epoch``.
    """

    def __init__(self) -> None:
        self.blocks: dict[bytes, IndexedBlock] = {}
        self.epoch: int | None = None
        self.last_seq: int | None = None
        self.counts = EventCounts()

    @property
    def from_seq(self) -> int | None:
        """The ``from_seq`` to resume with; None: subscribe without it (a snapshot comes first)."""
        return None if self.last_seq is None else self.last_seq + 1

    def request(self) -> pb.SubscribeEventsRequest:
        """The SubscribeEvents request that continues this index."""
        from_seq = self.from_seq
        if from_seq is None:
            return pb.SubscribeEventsRequest()
        return pb.SubscribeEventsRequest(from_seq=from_seq, epoch=self.epoch)  # another epoch: a snapshot first

    def resync(self) -> None:
        """Forget the resume point (keep the blocks until the snapshot replaces them): the next subscription
        asks for a snapshot."""
        self.epoch = self.last_seq = None

    def apply(self, batch: pb.SubscribeEventsResponse) -> bool:
        """Apply one batch; False if it was already applied (skipped). Raises EventGapError, changing nothing,
        when it does not follow the last one applied."""
        if not batch.snapshot:
            if self.last_seq is None or batch.epoch != self.epoch:
                what = "no snapshot yet" if self.epoch is None else f"epoch {self.epoch:x} (the server restarted)"
                raise EventGapError(f"batch {batch.seq} of epoch {batch.epoch:x} is not a snapshot, and the index "
                                    f"has {what}: resubscribe without from_seq", method="SubscribeEvents")
            if batch.seq <= self.last_seq:
                self.counts.num_duplicates += 1
                return False
            if batch.seq != self.last_seq + 1:
                raise EventGapError(f"batches {self.last_seq + 1}..{batch.seq - 1} of epoch {batch.epoch:x} are "
                                    "missing: resubscribe without from_seq", method="SubscribeEvents")
        counts = self.counts
        blocks = self.blocks
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                stored = event.block_stored
                size, parent, tokens = stored.block_size, stored.parent_block_hash, stored.token_ids
                extra, medium = stored.cache_extra_key, stored.medium
                for i, block_hash in enumerate(stored.block_hashes):
                    blocks[block_hash] = IndexedBlock(parent, tuple(tokens[i * size : (i + 1) * size]), size,
                                                      extra, medium)
                    parent = block_hash
                counts.num_blocks_stored += len(stored.block_hashes)
            elif kind == "block_removed":
                for block_hash in event.block_removed.block_hashes:
                    if blocks.pop(block_hash, None) is None:
                        counts.num_unknown_removed += 1
                counts.num_blocks_removed += len(event.block_removed.block_hashes)
            elif kind == "all_blocks_cleared":
                blocks.clear()
        self.epoch, self.last_seq = batch.epoch, batch.seq
        counts.num_batches += 1
        counts.num_snapshots += batch.snapshot
        return True

    def __eq__(self, other: object) -> bool:
        """Same blocks (the position and counts are not compared)."""
        return isinstance(other, EventIndex) and self.blocks == other.blocks

    __hash__ = None  # type: ignore[assignment]

    def __len__(self) -> int:
        return len(self.blocks)

    def __repr__(self) -> str:
        epoch = "-" if self.epoch is None else f"{self.epoch:x}"
        return f"EventIndex({len(self.blocks)} blocks, epoch {epoch}, last seq {self.last_seq})"
