"""SequenceIndex: which row of the block tables holds each live sequence."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError, InvariantViolationError, SequenceNotFoundError

# Ids are uint64. Callers may choose ids in [1, 2**63 - 1]; ids with the top bit set are the server's own:
#   server id = 2**63 | serial << ROW_BITS | row      (serial: a counter that only goes up)
# so the row of a server id is read off its low bits, without a search.
ROW_BITS = 24
MAX_ROWS = 1 << ROW_BITS
MAX_CALLER_SEQ_ID = 2**63 - 1
_SERVER_BIT = 1 << 63
_ROW_MASK = np.uint64(MAX_ROWS - 1)
_SERVER_BIT_U64 = np.uint64(_SERVER_BIT)


def check_caller_seq_id(seq_id: int) -> int:
    if not 1 <= seq_id <= MAX_CALLER_SEQ_ID:
        raise InvalidArgumentError(
            f"a caller-chosen seq_id must be in [1, 2**63 - 1] (ids with the top bit set are assigned by the "
            f"server), got {seq_id}"
        )
    return seq_id


def _not_live(seq_id: int) -> SequenceNotFoundError:
    return SequenceNotFoundError(f"sequence {seq_id} is not live (never registered, or freed)")


class SequenceIndex:
    """Maps each live seq_id to its row: one id at a time (a dict), or a whole batch with a few NumPy operations.

    A server-assigned id carries its row in its low ROW_BITS bits and a never-repeating serial above them, so a
    batch of server ids resolves as ``rows = ids & mask`` checked against ``row_to_id[rows] == ids`` -- no Python
    loop and no search. Caller-chosen ids (top bit clear) go through the dict. Because the serial only goes up, an
    id the server gave out is never given out again, and a stale id can never match a reused row.

    Invariants: ``_row_of`` and ``row_to_id`` hold the same (seq_id, row) pairs (``row_to_id`` is 0 on rows that
    hold no sequence); a server id's low bits equal its row.
    """

    def __init__(self, num_rows: int) -> None:
        self._row_of: dict[int, int] = {}
        self.row_to_id: np.ndarray = np.zeros(num_rows, dtype=np.uint64)
        self._next_serial: int = 1

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def seq_ids(self) -> list[int]:
        return list(self._row_of)

    def live_rows(self) -> np.ndarray:
        return np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))

    def resize(self, num_rows: int) -> None:
        grown = np.zeros(num_rows, dtype=np.uint64)
        grown[: self.row_to_id.size] = self.row_to_id
        self.row_to_id = grown

    def row(self, seq_id: int) -> int:
        row = self._row_of.get(seq_id)
        if row is None:
            raise _not_live(seq_id)
        return row

    def rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """Rows of a uint64 array of ids; raises SequenceNotFoundError naming the first id that is not live."""
        rows = (seq_ids & _ROW_MASK).astype(np.intp)
        row_to_id = self.row_to_id
        if rows.max() < row_to_id.size and (row_to_id[rows] == seq_ids).all():
            return rows  # the common case: every id is a live server id
        rows = rows.copy()
        for i, seq_id in enumerate(seq_ids.tolist()):
            row = self._row_of.get(seq_id)
            if row is None:
                raise _not_live(seq_id)
            rows[i] = row
        return rows

    def new_server_id(self, row: int) -> int:
        seq_id = _SERVER_BIT | (self._next_serial << ROW_BITS) | row
        self._next_serial += 1
        return seq_id

    def add(self, seq_id: int, row: int) -> None:
        self._row_of[seq_id] = row
        self.row_to_id[row] = seq_id

    def remove(self, seq_id: int) -> int:
        row = self._row_of.pop(seq_id)
        self.row_to_id[row] = 0
        return row

    def check_invariants(self) -> None:
        live = np.flatnonzero(self.row_to_id)
        pairs = {int(self.row_to_id[row]): int(row) for row in live}
        if pairs != self._row_of:
            raise InvariantViolationError("the id dict and row_to_id disagree")
        for seq_id, row in pairs.items():
            if seq_id & _SERVER_BIT and seq_id & (MAX_ROWS - 1) != row:
                raise InvariantViolationError(f"server id {seq_id} does not name its row {row}")
