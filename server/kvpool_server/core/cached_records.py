"""CachedRecords: what each cached pool block's hash was computed from, by block id -- its token ids in one
``[num_blocks, block_size]`` array, the rest in a plain tuple -- held where the cyclic garbage collector never
walks it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, ValuesView
from itertools import repeat
from typing import Any

import numpy as np

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.kv_event_types import CachedBlock

_as_cached_block = tuple.__new__  # (CachedBlock, fields): a CachedBlock of its fields, no argument parsing


class CachedRecords(Mapping[int, CachedBlock]):
    """A mapping of the pool's block ids ``[0, capacity)`` to ``CachedBlock``, read and written as a dict of them
    is (in the order the ids were first stored), whose records cost one plain tuple a block and the garbage
    collector nothing (docs/architecture.md, "The garbage collector").

    A record is ``records[block_id] = (block_hash, parent_hash, salt, extra)``, a plain tuple of bytes (the
    collector untracks it at the first young collection it survives), and its token ids row ``block_id`` of
    ``tokens``: uint32 ``[capacity, block_size]``, capacity x block_size x 4 bytes (4 MiB at 65,536 blocks of 16),
    allocated once, with the first record stored (the width of its token ids: the pool's block size; a record of
    another width is refused). ``serial[block_id]`` (int64, 8 bytes a block) numbers the records in the order
    they were stored, 0 where none is: the order of iteration. A sealing's blocks are stored as one scatter of
    their tokens and one of their serials (``add_new``): no NumPy array, bytes object, CachedBlock or dict entry a
    block. ``records`` is one list of ``capacity`` entries made with the container (``gc_policy.apply`` freezes it
    with the start-up heap).

    A read makes a CachedBlock (``[]``, ``get``, ``pop``, ``values``, a Mapping's ``items``) whose token ids are its
    own copy: the row is rewritten when the block is cached again, and a reader (the host tier, an eviction's plan)
    may keep it. ``hash_of`` reads one field without making one.

    Invariant (``check_invariants``): ``serial`` is positive exactly at the ids whose ``records`` entry is not
    None, there distinct and below ``next_serial``, and ``num`` counts them.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity: int = capacity
        self.records: list[Any] = [None] * capacity  # (block_hash, parent_hash, salt, extra), or None
        self.serial: np.ndarray = np.zeros(capacity, dtype=np.int64)  # the order stored; 0: no record
        self.next_serial: int = 1
        self.num: int = 0
        self.tokens: np.ndarray = np.zeros((capacity, 0), dtype=np.uint32)  # [capacity, block_size] once used

    def _tokens_of_width(self, width: int) -> np.ndarray:
        """``tokens``, allocated for ``width`` token ids a block at the first store; ValueError for another."""
        tokens = self.tokens
        if tokens.shape[1] != width:
            if tokens.shape[1] or width <= 0:
                raise ValueError(f"a cached block holds {tokens.shape[1]} token ids, not {width}")
            tokens = self.tokens = np.zeros((self.capacity, width), dtype=np.uint32)
        return tokens

    def check_tokens(self, tokens: np.ndarray, num: int) -> np.ndarray:
        """``tokens`` is the token ids of ``num`` blocks (``[num, block_size]``), else ValueError; returns the store."""
        if tokens.ndim != 2 or tokens.shape[0] != num:
            raise ValueError(f"token ids of shape {tokens.shape} for {num} blocks")
        return self._tokens_of_width(tokens.shape[1])

    def _record(self, key: object) -> Any:
        """The record of ``key``, or None (no record, or not a block id)."""
        if key.__class__ is not int:
            if not isinstance(key, (int, np.integer)) or isinstance(key, bool):
                return None
            key = int(key)
        return self.records[key] if 0 <= key < self.capacity else None

    def __len__(self) -> int:
        return self.num

    def __bool__(self) -> bool:
        return self.num > 0

    def __contains__(self, key: object) -> bool:
        return self._record(key) is not None

    def __iter__(self) -> Iterator[int]:
        return iter(self.ordered())

    def ordered(self) -> list[int]:
        """The ids holding a record, in the order stored."""
        held = np.flatnonzero(self.serial)
        return held[np.argsort(self.serial[held], kind="stable")].tolist()

    def _block(self, key: int, record: Any) -> CachedBlock:
        h, parent, salt, extra = record
        return CachedBlock(h, parent, self.tokens[key].copy(), salt, extra)

    def __getitem__(self, key: int) -> CachedBlock:
        record = self._record(key)
        if record is None:
            raise KeyError(key)
        return self._block(key, record)

    def get(self, key: int, default: CachedBlock | None = None) -> CachedBlock | None:  # type: ignore[override]
        record = self._record(key)
        return default if record is None else self._block(key, record)

    def hash_of(self, key: int) -> bytes:
        """``self[key].block_hash``, without making the CachedBlock."""
        record = self._record(key)
        if record is None:
            raise KeyError(key)
        return record[0]

    def __setitem__(self, key: int, entry: CachedBlock) -> None:
        if key.__class__ is not int and not isinstance(key, (int, np.integer)) or not 0 <= key < self.capacity:
            raise KeyError(key)
        tokens = self._tokens_of_width(entry.token_ids.size)
        tokens[key] = entry.token_ids
        if self.records[key] is None:  # a new id goes last; a record replaced keeps its place (as a dict's)
            self.serial[key] = self.next_serial
            self.next_serial += 1
            self.num += 1
        self.records[key] = (entry.block_hash, entry.parent_hash, entry.salt, entry.extra)

    def add_new(self, block_ids: list[int], fields: Iterable[tuple[bytes, bytes, bytes, bytes]],
                tokens: np.ndarray, index: list[int] | np.ndarray | None = None) -> bool:
        """Store the records of ``block_ids`` -- ``fields``: each one's (hash, parent, salt, extra); ``tokens``:
        uint32 [len(block_ids), block_size], theirs in order -- when they are distinct and none is held (a
        sealing's blocks, all new: a decode step's), in one scatter of the tokens and one of the serials (at
        ``index``: ``block_ids`` as an array, when the caller has one); else store nothing and return False."""
        store = self.check_tokens(tokens, len(block_ids))
        num = len(block_ids)
        if not num:
            return True
        at = block_ids if index is None else index  # block ids in [0, capacity): the pool's (a table's entries)
        serial, records = self.serial, self.records
        if num <= 64:  # a few blocks (a decode step's of a few rows): Python's checks cost less than NumPy's
            if any(map(records.__getitem__, block_ids)) or len(set(block_ids)) != num:  # one held, or repeated
                return False
            serial[at] = np.arange(self.next_serial, self.next_serial + num, dtype=np.int64)
        elif serial[at].any():  # one of them held
            return False
        else:  # the serials written, then read back: a block repeated (the last write won) is undone
            serials = np.arange(self.next_serial, self.next_serial + num, dtype=np.int64)
            serial[at] = serials
            if not np.array_equal(serial[at], serials):
                serial[at] = 0
                return False
        self.next_serial += num
        self.num += num
        for block_id, record in zip(block_ids, fields):
            records[block_id] = record
        store[at] = tokens
        return True

    def pop(self, key: int) -> CachedBlock:
        entry = self[key]  # KeyError when not held
        self._forget(key)
        return entry

    def __delitem__(self, key: int) -> None:
        self.pop(key)

    def _forget(self, key: int) -> None:
        self.records[key] = None
        self.serial[key] = 0
        self.num -= 1

    def pop_hash(self, key: int) -> bytes:
        """``self.pop(key).block_hash``, without making the CachedBlock."""
        h = self.hash_of(key)  # KeyError when not held
        self._forget(key)
        return h

    def pop_records(self, keys: list[int]) -> list[Any]:
        """The records (the plain tuples, no token ids) of ``keys`` -- distinct, every one held -- in order, and none
        of them held any more: an eviction's, which reads the hashes (``[0]``) and makes CachedBlocks (``blocks``,
        before the rows are written again) only where a keeper takes them."""
        records = self.records
        taken = list(map(records.__getitem__, keys))  # block ids in [0, capacity): the policy's victims
        if None in taken:  # before anything changes: a key not held
            raise KeyError(keys[taken.index(None)])
        for key in keys:
            records[key] = None
        self.serial[keys] = 0
        self.num -= len(keys)
        return taken

    def blocks(self, keys: list[int], records: list[Any]) -> list[CachedBlock]:
        """The CachedBlocks of ``records`` (``pop_records`` of ``keys``, their rows not written since): the token
        ids of all of them one copy (each a row of it)."""
        if not keys:
            return []
        return [CachedBlock(h, parent, tokens, salt, extra)
                for (h, parent, salt, extra), tokens in zip(records, self.tokens[keys])]

    def values(self) -> ValuesView[CachedBlock]:
        return _Values(self)

    def check_invariants(self) -> None:
        held = [i for i, record in enumerate(self.records) if record is not None]
        serials = self.serial[held]
        if set(np.flatnonzero(self.serial).tolist()) != set(held) or len(held) != self.num or \
                len(set(serials.tolist())) != len(held) or (held and serials.max() >= self.next_serial):
            raise InvariantViolationError("CachedRecords: the serials, the records and the count disagree")


class _Values(ValuesView[CachedBlock]):
    """``CachedRecords.values()``: the records made CachedBlocks, the token ids of all of them one gather (a
    snapshot reads every cached block), not one ``[]`` each."""

    _mapping: CachedRecords

    def __iter__(self) -> Iterator[CachedBlock]:
        records = self._mapping
        keys = records.ordered()
        if not keys:
            return iter(())
        rows = records.tokens[keys]
        fields = map(records.records.__getitem__, keys)
        return map(_as_cached_block, repeat(CachedBlock),
                   ((h, parent, tokens, salt, extra) for (h, parent, salt, extra), tokens in zip(fields, rows)))
