"""SequenceIndex: which row of the block tables holds each live sequence."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError, InvariantViolationError, SequenceNotFoundError

# Valid seq_ids are 1 .. MAX_SEQ_ID. 0 is reserved (the protobuf default) and 2**64 - 1 is the search sentinel.
MAX_SEQ_ID = 2**64 - 2
_SENTINEL = np.uint64(2**64 - 1)


def check_seq_id(seq_id: int) -> int:
    if not 1 <= seq_id <= MAX_SEQ_ID:
        raise InvalidArgumentError(f"seq_id must be in [1, 2**64 - 2], got {seq_id}")
    return seq_id


class SequenceIndex:
    """Maps each live seq_id to its row, one id at a time (a dict) or a whole batch at once (binary search).

    A batch lookup runs ``np.searchsorted`` over ``_sorted_ids`` (strictly increasing, ending in a sentinel larger
    than any valid id) instead of a Python loop over the dict, so resolving 256 ids costs a few microseconds.
    Server-assigned ids come from a counter that only goes up: an id the server gave out is never given out again.

    Invariants: ``_row_of`` and the pair (``_sorted_ids``, ``_sorted_rows``) hold the same (seq_id, row) pairs;
    ``_sorted_ids`` is strictly increasing and ends with the sentinel; rows are distinct.
    """

    def __init__(self) -> None:
        self._row_of: dict[int, int] = {}
        self._sorted_ids: np.ndarray = np.array([_SENTINEL], dtype=np.uint64)
        self._sorted_rows: np.ndarray = np.array([-1], dtype=np.int64)
        self._next_seq_id: int = 1

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def seq_ids(self) -> list[int]:
        return list(self._row_of)

    def live_rows(self) -> np.ndarray:
        return self._sorted_rows[:-1]

    def row(self, seq_id: int) -> int:
        row = self._row_of.get(seq_id)
        if row is None:
            raise SequenceNotFoundError(f"sequence {seq_id} is not live (never registered, or freed)")
        return row

    def rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """Rows of a uint64 array of ids; raises SequenceNotFoundError naming the first id that is not live."""
        pos = np.searchsorted(self._sorted_ids, seq_ids)
        found = self._sorted_ids[pos] == seq_ids
        if not found.all():
            missing = int(seq_ids[np.argmin(found)])
            raise SequenceNotFoundError(f"sequence {missing} is not live (never registered, or freed)")
        return self._sorted_rows[pos]

    def next_seq_id(self) -> int:
        """The next server-assigned id, skipping ids that callers chose themselves."""
        seq_id = self._next_seq_id
        while seq_id in self._row_of:
            seq_id += 1
        self._next_seq_id = seq_id + 1
        return seq_id

    def add(self, seq_id: int, row: int) -> None:
        self._row_of[seq_id] = row
        pos = int(np.searchsorted(self._sorted_ids, np.uint64(seq_id)))
        self._sorted_ids = np.insert(self._sorted_ids, pos, np.uint64(seq_id))
        self._sorted_rows = np.insert(self._sorted_rows, pos, row)

    def remove(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            del self._row_of[seq_id]
        pos = np.searchsorted(self._sorted_ids, np.asarray(seq_ids, dtype=np.uint64))
        self._sorted_ids = np.delete(self._sorted_ids, pos)
        self._sorted_rows = np.delete(self._sorted_rows, pos)

    def check_invariants(self) -> None:
        ids, rows = self._sorted_ids, self._sorted_rows
        if ids[-1] != _SENTINEL or ids.size != len(self._row_of) + 1:
            raise InvariantViolationError("sorted id index lost its sentinel or its size")
        if ids.size > 1 and not (ids[1:] > ids[:-1]).all():
            raise InvariantViolationError("sorted id index is not strictly increasing")
        if {int(i): int(r) for i, r in zip(ids[:-1], rows[:-1])} != self._row_of:
            raise InvariantViolationError("sorted id index and dict disagree")
        if np.unique(rows[:-1]).size != rows.size - 1:
            raise InvariantViolationError("two live sequences share a row")
