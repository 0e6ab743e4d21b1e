"""BlockRecords: what each cached block's hash was computed from (its ``CachedBlock``), by block id, held where the
cyclic garbage collector never walks it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, ValuesView
from itertools import repeat
from typing import Any

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.kv_event_types import CachedBlock

_as_cached_block = tuple.__new__  # (CachedBlock, fields): a CachedBlock of a record's fields, no argument parsing


class BlockRecords(Mapping[int, CachedBlock]):
    """A mapping of ids in ``[0, capacity)`` (the pool's blocks, the host tier's slots) to ``CachedBlock``, read
    and written as a dict of them is (in the order the ids were first stored), that costs the garbage collector
    nothing however many blocks are cached (docs/architecture.md, "The garbage collector").

    A CachedBlock is a NamedTuple, which the collector tracks for as long as it lives (it untracks only exact
    tuples): 131 k cached blocks made every full collection walk 131 k objects, 50-110 ms (benchmarks/
    bench_gc_pause.py). Here each record rests as a plain tuple of the same fields -- bytes and a NumPy array,
    neither followed by the collector -- which the collector untracks at the first young collection it survives,
    so it never reaches the old generation. The records sit in one list of ``capacity`` entries made with the
    container (``gc_policy.apply`` freezes it with the start-up heap: no collection walks it), and ``order``, ids
    to None, keeps insertion order, membership and the count: a dict of ints, which the collector never tracks.
    A read makes a CachedBlock of the record (``[]``, ``get``, ``pop``, ``values``, and a Mapping's ``items``); ``hash_of`` reads
    one field without making one.

    Invariant: ``order`` holds exactly the ids whose ``records`` entry is not None.
    """

    def __init__(self, capacity: int) -> None:
        self.records: list[Any] = [None] * capacity  # a record's fields as a tuple, or None
        self.order: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self.order)

    def __bool__(self) -> bool:
        return bool(self.order)

    def __contains__(self, key: object) -> bool:
        return key in self.order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __getitem__(self, key: int) -> CachedBlock:
        if key not in self.order:
            raise KeyError(key)
        return _as_cached_block(CachedBlock, self.records[key])

    def get(self, key: int, default: CachedBlock | None = None) -> CachedBlock | None:  # type: ignore[override]
        return _as_cached_block(CachedBlock, self.records[key]) if key in self.order else default

    def hash_of(self, key: int) -> bytes:
        """``self[key].block_hash``, without making the CachedBlock."""
        record = self.records[key] if key in self.order else None
        if record is None:
            raise KeyError(key)
        return record[0]

    def __setitem__(self, key: int, entry: CachedBlock) -> None:
        if key < 0:  # a list would take it from the end
            raise KeyError(key)
        self.records[key] = tuple(entry)
        self.order[key] = None

    def pop(self, key: int) -> CachedBlock:
        del self.order[key]  # KeyError when not held
        record, self.records[key] = self.records[key], None
        return _as_cached_block(CachedBlock, record)

    def __delitem__(self, key: int) -> None:
        self.pop(key)

    def pop_hash(self, key: int) -> bytes:
        """``self.pop(key).block_hash``, without making the CachedBlock."""
        del self.order[key]  # KeyError when not held
        record, self.records[key] = self.records[key], None
        return record[0]

    def pop_records(self, keys: list[int]) -> list[Any]:
        """The records (plain tuples of a CachedBlock's fields, not CachedBlocks) of ``keys`` -- distinct, every one
        held -- in order, and none of them held any more: an eviction's, which reads the hashes (``[0]``) and makes
        CachedBlocks only where a keeper takes them."""
        order, records = self.order, self.records
        taken = list(map(records.__getitem__, keys))
        if None in taken:  # before anything changes: a key not held
            raise KeyError(keys[taken.index(None)])
        for key in keys:
            del order[key]
            records[key] = None
        return taken

    def copy_from(self, key: int, other: Mapping[int, CachedBlock], other_key: int) -> None:
        """``self[key] = other[other_key]``; when ``other`` is a BlockRecords too, its record itself (a tuple:
        shared, never copied or made a CachedBlock)."""
        if key < 0:
            raise KeyError(key)
        if isinstance(other, BlockRecords):
            if other_key not in other.order:
                raise KeyError(other_key)
            self.records[key] = other.records[other_key]
            self.order[key] = None
        else:
            self[key] = other[other_key]

    def values(self) -> ValuesView[CachedBlock]:
        return _Values(self)

    def check_invariants(self) -> None:
        if set(self.order) != {i for i, record in enumerate(self.records) if record is not None}:
            raise InvariantViolationError("BlockRecords: the ids in order are not exactly those holding a record")


class _Values(ValuesView[CachedBlock]):
    """``BlockRecords.values()``: the records made CachedBlocks in one ``map`` (a snapshot reads every cached
    block), not one ``[]`` each."""

    _mapping: BlockRecords

    def __iter__(self) -> Iterator[CachedBlock]:
        records = self._mapping
        return map(_as_cached_block, repeat(CachedBlock), map(records.records.__getitem__, records.order))
