"""TenantIds: with tenancy on, each tenant names its sequences in a namespace of its own.

A tenant's id X and another tenant's id X are two different sequences, and no answer to one tenant depends on
another tenant's ids: a caller-chosen id is refused (ALREADY_EXISTS) only when the caller's own tenant holds it,
and a server-assigned id is made from the tenant's own state alone::

    server id (tenant t) = serial_t << slot_bits | slot      serial_t: t's counter, from a random start, only up
                                                             slot:     a slot of t's own (the last it freed first)

Two ids a tenant was given in a row therefore differ by one in the serial, whatever other tenants did in between,
and the low bits are a slot of the tenant's own table (which of its own sequences are live), never a row of the
shared block tables (which would tell how many sequences others hold). Like the SequenceIndex's, a batch of a
tenant's server ids resolves with a few NumPy operations: ``slots = ids & mask``, proved by
``slot_to_id[slots] == ids``, then ``rows = slot_to_row[slots]``. A tenant's slot arrays start at
``MIN_SLOTS`` entries and double as its live sequences need, up to ``2**slot_bits`` (16 bytes a slot).

The manager keeps the shared SequenceIndex beside this, holding a server-assigned internal id for every row: the
id trusted callers (``tenant=None``: a session's end, tests) name sequences by. The translation is one way each:
(tenant, id) -> row here, row -> internal id there, row -> the tenant's id in ``id_of_row``.

Invariant (``check_invariants``): every live row is in exactly its tenant's namespace, under ``id_of_row[row]``;
each namespace's dict and slot arrays agree (a server id's slot holds it and its row, a free slot ``s`` holds
``s ^ 1``, which no id can match, and is on the free list, whose slots are distinct).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError, InvariantViolationError
from kvpool_server.core.seq_index import RepeatFinder, not_live

MIN_SLOTS = 64


class Namespace:
    """One tenant's ids: id -> row for every id (a dict), and the slot arrays of its server-assigned ids."""

    def __init__(self, slot_bits: int) -> None:
        self.slot_bits: int = slot_bits
        self.mask: np.uint64 = np.uint64((1 << slot_bits) - 1)
        size = min(MIN_SLOTS, 1 << slot_bits)
        self.row_of: dict[int, int] = {}
        self.slot_of_row: dict[int, int] = {}  # rows named by a server id -> their slot
        self.slot_to_id: np.ndarray = np.arange(size, dtype=np.uint64) ^ np.uint64(1)
        self.slot_to_row: np.ndarray = np.zeros(size, dtype=np.intp)
        self.free_slots: list[int] = list(range(size - 1, -1, -1))
        self.next_serial: int = 1 + int.from_bytes(os.urandom(8), "little") % (1 << (62 - slot_bits))

    def new_id(self, row: int) -> int:
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        while True:
            seq_id = (self.next_serial << self.slot_bits) | slot
            self.next_serial += 1
            if seq_id not in self.row_of:  # the tenant may have chosen it
                break
        self.slot_of_row[row] = slot
        self.slot_to_id[slot] = seq_id
        self.slot_to_row[slot] = row
        return seq_id

    def _grow(self) -> None:
        old = self.slot_to_id.size  # every slot is taken: the caller checked max_num_seqs first
        self.slot_to_id = np.concatenate([self.slot_to_id, np.arange(old, 2 * old, dtype=np.uint64) ^ np.uint64(1)])
        self.slot_to_row = np.concatenate([self.slot_to_row, np.zeros(old, dtype=np.intp)])
        self.free_slots = list(range(2 * old - 1, old - 1, -1))

    def remove(self, seq_id: int, row: int) -> None:
        del self.row_of[seq_id]
        slot = self.slot_of_row.pop(row, None)
        if slot is not None:
            self.slot_to_id[slot] = slot ^ 1
            self.free_slots.append(slot)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows of a batch of this tenant's ids; NOT_FOUND names the first that is not its live sequence."""
        slots = (ids & self.mask).view(np.intp)
        # mode="clip": a slot past the arrays reads the last entry, whose low bits (or, free, whose value) differ
        if not np.count_nonzero(self.slot_to_id.take(slots, mode="clip") != ids):
            return self.slot_to_row.take(slots)
        rows = np.empty(ids.size, dtype=np.intp)
        for i, seq_id in enumerate(ids.tolist()):
            row = self.row_of.get(seq_id)
            if row is None:
                raise not_live(seq_id)
            rows[i] = row
        return rows


class TenantIds:
    """The tenants' namespaces (made on a tenant's first sequence) and the tenant's id of each live row."""

    def __init__(self, max_rows: int, slot_bits: int) -> None:
        self.slot_bits: int = slot_bits
        self.spaces: dict[int, Namespace] = {}
        self.id_of_row: np.ndarray = np.zeros(max_rows, dtype=np.uint64)  # 0 for a free row
        self._repeats: RepeatFinder = RepeatFinder(max_rows)

    def _space(self, tenant: int) -> Namespace:
        space = self.spaces.get(tenant)
        if space is None:
            space = self.spaces[tenant] = Namespace(self.slot_bits)
        return space

    def holds(self, tenant: int, seq_id: int) -> bool:
        space = self.spaces.get(tenant)
        return space is not None and seq_id in space.row_of

    def row(self, tenant: int, seq_id: int) -> int:
        space = self.spaces.get(tenant)
        row = None if space is None else space.row_of.get(seq_id)
        if row is None:
            raise not_live(seq_id)
        return row

    def resolve(self, tenant: int, seq_ids: int | Sequence[int] | np.ndarray) -> int | np.ndarray:
        """Like SequenceIndex.resolve, in ``tenant``'s namespace: an int for one id, else an intp array."""
        if isinstance(seq_ids, (int, np.integer)):
            return self.row(tenant, int(seq_ids))
        ids = np.asarray(seq_ids, dtype=np.uint64)
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidArgumentError("append needs a non-empty list of seq_ids")
        space = self.spaces.get(tenant)
        if space is None:
            raise not_live(int(ids[0]))
        rows = space.rows(ids)
        if rows.size == 1:
            return rows.item(0)
        if self._repeats.any_repeated(rows):
            raise InvalidArgumentError("the batch names a sequence twice")
        return rows

    def add(self, tenant: int, row: int, seq_id: int | None) -> int:
        """Name ``row`` in ``tenant``'s namespace: ``seq_id`` (checked free by the caller) or a new server id."""
        space = self._space(tenant)
        if seq_id is None:
            seq_id = space.new_id(row)
        space.row_of[seq_id] = row
        self.id_of_row[row] = seq_id
        return seq_id

    def remove(self, tenant: int, row: int) -> None:
        self.spaces[tenant].remove(self.id_of_row.item(row), row)
        self.id_of_row[row] = 0

    def check_invariants(self, live_rows: np.ndarray, tenant_of_row: np.ndarray) -> None:
        named = {(t, row) for t, space in self.spaces.items() for row in space.row_of.values()}
        if named != {(tenant_of_row.item(row), row) for row in live_rows.tolist()}:
            raise InvariantViolationError("the tenants' namespaces do not name exactly the live rows, each in its tenant's")
        if np.count_nonzero(np.delete(self.id_of_row, live_rows)):
            raise InvariantViolationError("a free row still has a tenant's id")
        for space in self.spaces.values():
            if any(self.id_of_row.item(row) != seq_id for seq_id, row in space.row_of.items()):
                raise InvariantViolationError("a namespace and id_of_row disagree")
            expected = np.arange(space.slot_to_id.size, dtype=np.uint64) ^ np.uint64(1)
            for row, slot in space.slot_of_row.items():
                expected[slot] = self.id_of_row[row]
                if space.slot_to_row.item(slot) != row:
                    raise InvariantViolationError(f"slot {slot} does not hold row {row}")
            free = set(space.free_slots)
            if (not np.array_equal(expected, space.slot_to_id) or len(free) != len(space.free_slots)
                    or free & set(space.slot_of_row.values())
                    or len(free) + len(space.slot_of_row) != space.slot_to_id.size):
                raise InvariantViolationError("a namespace's slots disagree with its server ids or free list")
