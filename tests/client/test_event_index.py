"""EventIndex (kvpool_client/events.py) on hand-made batches: what it applies, skips and refuses."""

from __future__ import annotations

import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import EventGapError, EventIndex, IndexedBlock


def stored(hashes: list[bytes], parent: bytes, tokens: list[int], block_size: int = 2) -> pb.KVEvent:
    return pb.KVEvent(block_stored=pb.BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                                  block_size=block_size))


def removed(hashes: list[bytes]) -> pb.KVEvent:
    return pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=hashes))


def batch(seq: int, *events: pb.KVEvent, epoch: int = 7, snapshot: bool = False) -> pb.SubscribeEventsResponse:
    if snapshot:
        events = (pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()), *events)
    return pb.SubscribeEventsResponse(epoch=epoch, seq=seq, events=events, snapshot=snapshot)


def test_a_snapshot_then_consecutive_batches() -> None:
    index = EventIndex()
    assert index.from_seq is None and not index.request().HasField("from_seq")
    assert index.apply(batch(3, stored([b"a"], b"", [1, 2]), snapshot=True))
    assert index.apply(batch(4, stored([b"b", b"c"], b"a", [3, 4, 5, 6])))  # a run of two blocks (vLLM's form)
    assert index.blocks == {b"a": IndexedBlock(b"", (1, 2), 2), b"b": IndexedBlock(b"a", (3, 4), 2),
                            b"c": IndexedBlock(b"b", (5, 6), 2)}
    assert index.apply(batch(5, removed([b"c", b"b"])))
    assert set(index.blocks) == {b"a"} and (index.epoch, index.last_seq, index.from_seq) == (7, 5, 6)
    assert index.request().from_seq == 6
    assert (index.counts.num_blocks_stored, index.counts.num_blocks_removed, index.counts.num_batches) == (3, 2, 3)


def test_a_batch_already_applied_is_skipped() -> None:
    index = EventIndex()
    index.apply(batch(1, stored([b"a"], b"", [1, 2]), snapshot=True))
    index.apply(batch(2, removed([b"a"])))
    assert not index.apply(batch(2, removed([b"a"])))
    assert not index.apply(batch(1, stored([b"a"], b"", [1, 2])))
    assert index.blocks == {} and index.last_seq == 2 and index.counts.num_duplicates == 2


@pytest.mark.parametrize("bad", [
    batch(4, stored([b"x"], b"", [0, 0])),  # seq 3 is missing
    batch(3, stored([b"x"], b"", [0, 0]), epoch=8),  # the server restarted: its seq 3 is not ours
])
def test_a_gap_or_a_new_epoch_without_a_snapshot_raises_and_changes_nothing(bad) -> None:
    index = EventIndex()
    index.apply(batch(2, stored([b"a"], b"", [1, 2]), snapshot=True))
    with pytest.raises(EventGapError, match="resubscribe without from_seq"):
        index.apply(bad)
    assert set(index.blocks) == {b"a"} and (index.epoch, index.last_seq) == (7, 2)
    index.resync()
    assert index.from_seq is None
    index.apply(batch(9, stored([b"y"], b"", [5, 5]), epoch=8, snapshot=True))  # the snapshot replaces it all
    assert set(index.blocks) == {b"y"} and (index.epoch, index.from_seq) == (8, 10)


def test_a_live_batch_before_any_snapshot_raises() -> None:
    with pytest.raises(EventGapError, match="no snapshot yet"):
        EventIndex().apply(batch(1, stored([b"a"], b"", [1, 2])))


def test_equality_is_the_blocks() -> None:
    a, b = EventIndex(), EventIndex()
    a.apply(batch(5, stored([b"a"], b"", [1, 2]), snapshot=True))
    b.apply(batch(1, snapshot=True))
    assert a != b
    b.apply(batch(2, stored([b"a"], b"", [1, 2])))
    assert a == b and len(a) == 1
