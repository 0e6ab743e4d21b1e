"""BlockRecords (core/block_records.py): read and written as a dict of CachedBlock; ``pop_hash``, ``pop_records``
(an eviction's) and ``copy_from`` (the host tier's write-back: a slot takes a pool block's record as it is) keep its
invariant."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.core.block_records import BlockRecords
from kvpool_server.core.kv_event_types import CachedBlock


def entry(i: int) -> CachedBlock:
    return CachedBlock(bytes([i]) * 32, b"\0" * 32, np.array([i], dtype=np.uint32), b"", b"")


def test_pop_hash_and_copy_from_read_and_write_as_the_mapping_does() -> None:
    pool, tier = BlockRecords(4), BlockRecords(2)
    pool[3] = entry(3)
    tier.copy_from(1, pool, 3)  # the record itself: shared, not copied
    assert tier.records[1] is pool.records[3] and tier[1] == pool[3] and list(tier) == [1]
    tier.copy_from(0, {7: entry(7)}, 7)  # any mapping of CachedBlock
    assert tier[0] == entry(7) and list(tier) == [1, 0]
    assert tier.pop_hash(1) == entry(3).block_hash and 1 not in tier and tier.records[1] is None
    tier.check_invariants()
    with pytest.raises(KeyError):
        tier.pop_hash(1)
    with pytest.raises(KeyError):
        tier.copy_from(1, pool, 2)  # the pool holds no record of block 2
    with pytest.raises(KeyError):
        tier.copy_from(-1, pool, 3)
    assert list(tier) == [0]
    tier.check_invariants()


def test_pop_records_takes_the_records_in_order_or_nothing() -> None:
    records = BlockRecords(6)
    for i in (4, 1, 5, 2):
        records[i] = entry(i)
    with pytest.raises(KeyError):
        records.pop_records([5, 3])  # 3 is not held: nothing taken
    assert list(records) == [4, 1, 5, 2]
    taken = records.pop_records([5, 4])
    assert [CachedBlock(*r) for r in taken] == [entry(5), entry(4)] and all(r.__class__ is tuple for r in taken)
    assert list(records) == [1, 2] and records.records[5] is None and records.records[4] is None
    records.check_invariants()
