"""SequenceIndex: which row of the block tables holds each live sequence."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError, InvariantViolationError, SequenceNotFoundError

# Ids are uint64; 0 is never an id (it is protobuf's "unset"). A server-assigned id is
#   serial << row_bits | row      (serial: a counter that only goes up; row_bits = bits of max_num_seqs - 1)
# so the row of a server id is read off its low bits, without a search. The serial starts at a random value in
# [1, 2**(62 - row_bits)) at every server start, and only goes up from there: within a start no id repeats, and an
# id of an earlier start is live again only if this start's serial range reaches it -- with 2**50 start values (at
# the default 4096 rows) and a few million registrations a start, about one chance in 10**8 per restart. So an old
# id after a restart is NOT_FOUND, not someone else's sequence. (Server ids are 8-9 byte varints on the wire.)
MAX_ROWS = 1 << 20
# 2**64 - 1 is reserved too: it is what a -1 becomes when a client's sign bug sends it as a uint64.
MAX_SEQ_ID = 2**64 - 2


def check_caller_seq_id(seq_id: int) -> int:
    if not 1 <= seq_id <= MAX_SEQ_ID:
        raise InvalidArgumentError(
            f"a seq_id must be in [1, 2**64 - 2] (0 means unset; 2**64 - 1 is a -1 sent as uint64), got {seq_id}"
        )
    return seq_id


def not_live(seq_id: int) -> SequenceNotFoundError:
    return SequenceNotFoundError(f"sequence {seq_id} is not live (never registered, or freed)")


class SequenceIndex:
    """Maps each live seq_id to its row: one id at a time (a dict), or a whole batch with a few NumPy operations.

    A server-assigned id carries its row in its low ``row_bits`` bits and a never-repeating serial above them, so
    a batch of server ids resolves as ``rows = ids & mask`` checked by ``row_to_id[rows] == ids`` -- no Python
    loop, no search and no bounds check (``row_to_id`` has an entry for every value of the low bits). Any id that
    fails that check (a caller-chosen one, say) goes through the dict. Because the serial only goes up (from a
    random start, so that a restarted server does not hand out its predecessor's ids), an id the server gave out is
    never given out again, a stale id never matches a reused row, and an id a caller holds is skipped.

    Invariant (``check_invariants``): ``_row_of`` and the live entries of ``row_to_id`` hold the same (seq_id, row)
    pairs; every other entry ``r`` holds ``r ^ 1``, a value whose low bits name another row, so that no id (0 and
    2**64 - 1 included) can match a row that holds no sequence.
    """

    def __init__(self, max_rows: int) -> None:
        if not 1 <= max_rows <= MAX_ROWS:
            raise InvalidArgumentError(f"max_num_seqs must be in [1, {MAX_ROWS}], got {max_rows}")
        self.row_bits: int = max(1, (max_rows - 1).bit_length())
        self._row_mask: np.uint64 = np.uint64((1 << self.row_bits) - 1)
        self._row_of: dict[int, int] = {}
        self.row_to_id: np.ndarray = np.arange(1 << self.row_bits, dtype=np.uint64) ^ np.uint64(1)
        # A random start, so that ids of a restarted server do not repeat an earlier start's (module docstring).
        self._next_serial: int = 1 + int.from_bytes(os.urandom(8), "little") % (1 << (62 - self.row_bits))
        self._repeats: RepeatFinder = RepeatFinder(self.row_to_id.size)  # scratch for rows()

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def seq_ids(self) -> list[int]:
        return list(self._row_of)

    def live_rows(self) -> np.ndarray:
        return np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))

    def row(self, seq_id: int) -> int:
        row = self._row_of.get(seq_id)
        if row is None:
            raise not_live(seq_id)
        return row

    def rows(self, seq_ids: np.ndarray) -> np.ndarray:
        """Rows of a batch (a uint64 array) of ids. Raises SequenceNotFoundError naming the first id that is not
        live, then InvalidArgumentError if the batch names a sequence twice."""
        rows = (seq_ids & self._row_mask).view(np.intp)
        if not self.hold(rows, seq_ids):  # not the common case, where every id is a live server id
            for i, seq_id in enumerate(seq_ids.tolist()):
                row = self._row_of.get(seq_id)
                if row is None:
                    raise not_live(seq_id)
                rows[i] = row
        if rows.size > 1 and self._repeats.any_repeated(rows):
            raise InvalidArgumentError("the batch names a sequence twice")
        return rows

    def resolve(self, seq_ids: int | Sequence[int] | np.ndarray) -> int | np.ndarray:
        """The rows of one id or a non-empty batch of distinct live ids: an int for one sequence (the tables plan it
        in scalars), else an intp array."""
        if isinstance(seq_ids, (int, np.integer)):
            return self.row(int(seq_ids))
        ids = np.asarray(seq_ids, dtype=np.uint64)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidArgumentError("append needs a non-empty list of seq_ids")
        rows = self.rows(ids)
        return rows.item(0) if rows.size == 1 else rows

    def hold(self, rows: np.ndarray, seq_ids: np.ndarray) -> bool:
        """Whether row ``rows[i]`` holds live sequence ``seq_ids[i]`` for every i (one gather, one compare)."""
        return not np.count_nonzero(self.row_to_id.take(rows) != seq_ids)

    def new_server_id(self, row: int) -> int:
        while True:
            seq_id = (self._next_serial << self.row_bits) | row
            self._next_serial += 1
            if seq_id not in self._row_of:  # a caller may hold it
                return seq_id

    def add_server_ids(self, rows: list[int], row_array: np.ndarray) -> list[int]:
        """``add(new_server_id(row), row)`` for each of the distinct free ``rows`` (``row_array``: the same, intp) in
        turn: the same ids, made and added with a few NumPy operations unless an id a caller holds is among them
        (then one by one, skipping those)."""
        serial, num = self._next_serial, len(rows)
        ids = (np.arange(serial, serial + num, dtype=np.uint64) << np.uint64(self.row_bits)) | row_array.view(np.uint64)
        id_list = ids.tolist()
        if not self._row_of.keys().isdisjoint(id_list):
            id_list = [self.new_server_id(row) for row in rows]
            self.add_many(id_list, rows)
            return id_list
        self._next_serial = serial + num
        self._row_of.update(zip(id_list, rows))
        self.row_to_id[row_array] = ids
        return id_list

    def add(self, seq_id: int, row: int) -> None:
        self._row_of[seq_id] = row
        self.row_to_id[row] = seq_id

    def add_many(self, seq_ids: list[int], rows: list[int]) -> None:
        """``add`` of each (distinct, new) id and its row."""
        self._row_of.update(zip(seq_ids, rows))
        self.row_to_id[rows] = np.array(seq_ids, dtype=np.uint64)

    def remove(self, seq_id: int) -> int:
        row = self._row_of.pop(seq_id)
        self.row_to_id[row] = row ^ 1
        return row

    def check_invariants(self) -> None:
        expected = np.arange(self.row_to_id.size, dtype=np.uint64) ^ np.uint64(1)
        for seq_id, row in self._row_of.items():
            expected[row] = seq_id
        if not np.array_equal(expected, self.row_to_id):
            raise InvariantViolationError("the id dict and row_to_id disagree")


class RepeatFinder:
    """Finds a row named twice in a batch without sorting: stamp each row with its position in the batch, read the
    stamps back; a row named twice reads back its later position at its earlier one. Scratch arrays, made once."""

    def __init__(self, num_rows: int) -> None:
        self._stamp: np.ndarray = np.zeros(num_rows, dtype=np.int64)
        self._positions: np.ndarray = np.arange(min(num_rows, 1 << 16), dtype=np.int64)

    def any_repeated(self, rows: np.ndarray) -> bool:
        if self._positions.size < rows.size:
            self._positions = np.arange(max(rows.size, 2 * self._positions.size), dtype=np.int64)
        positions = self._positions[: rows.size]
        self._stamp[rows] = positions
        return bool(np.count_nonzero(self._stamp.take(rows) != positions))
