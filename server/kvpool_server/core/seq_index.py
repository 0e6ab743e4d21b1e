"""SequenceIndex: which row of the block tables holds each live sequence."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError, InvariantViolationError, SequenceNotFoundError

# Ids are uint64; 0 is never an id (it is protobuf's "unset"). A server-assigned id is
#   serial << row_bits | row      (serial: a counter that only goes up; row_bits = bits of max_num_seqs - 1)
# so the row of a server id is read off its low bits, without a search, and ids stay short on the wire.
MAX_ROWS = 1 << 24
# 2**64 - 1 is reserved too: it is what a -1 becomes when a client's sign bug sends it as a uint64.
MAX_SEQ_ID = 2**64 - 2


def check_caller_seq_id(seq_id: int) -> int:
    if not 1 <= seq_id <= MAX_SEQ_ID:
        raise InvalidArgumentError(
            f"a seq_id must be in [1, 2**64 - 2] (0 means unset; 2**64 - 1 is a -1 sent as uint64), got {seq_id}"
        )
    return seq_id


def _not_live(seq_id: int) -> SequenceNotFoundError:
    return SequenceNotFoundError(f"sequence {seq_id} is not live (never registered, or freed)")


class SequenceIndex:
    """Maps each live seq_id to its row: one id at a time (a dict), or a whole batch with a few NumPy operations.

    A server-assigned id carries its row in its low ``row_bits`` bits and a never-repeating serial above them, so
    a batch of server ids resolves as ``rows = ids & mask`` checked against ``row_to_id[rows] == ids`` -- no Python
    loop and no search. Any id that fails that check (a caller-chosen one, say) goes through the dict. Because the
    serial only goes up, an id the server gave out is never given out again, a stale id never matches a reused
    row, and an id a caller holds is skipped.

    Invariants: ``_row_of`` and ``row_to_id`` hold the same (seq_id, row) pairs (``row_to_id`` is 0 on rows that
    hold no sequence).
    """

    def __init__(self, num_rows: int, max_rows: int) -> None:
        self.row_bits: int = max(1, (max_rows - 1).bit_length())
        self._row_mask: np.uint64 = np.uint64((1 << self.row_bits) - 1)
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
        rows = (seq_ids & self._row_mask).astype(np.intp)
        row_to_id = self.row_to_id
        # A free row holds 0, which is never an id: so 0 must not match one (seq_ids.all()).
        if rows.max() < row_to_id.size and (row_to_id[rows] == seq_ids).all() and seq_ids.all():
            return rows  # the common case: every id is a live server id
        rows = rows.copy()
        for i, seq_id in enumerate(seq_ids.tolist()):
            row = self._row_of.get(seq_id)
            if row is None:
                raise _not_live(seq_id)
            rows[i] = row
        return rows

    def new_server_id(self, row: int) -> int:
        while True:
            seq_id = (self._next_serial << self.row_bits) | row
            self._next_serial += 1
            if seq_id not in self._row_of:  # a caller may hold it
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
