"""SequenceBatch: bench_core's persistent decode batch, resolved once and stepped many times (vLLM's InputBatch idea).

Not part of the core or the server: the server gets its ids with every request and resolves them with
``manager.append``. This driver shows what a decode loop inside the server's process could save by keeping the
resolved rows between steps; it calls the block tables (``manager.tables.plan_append``) directly.
"""

from __future__ import annotations

import numpy as np

from kvpool_server.core import AppendPlan, InvalidArgumentError, KVCacheManager, SequenceNotFoundError


class SequenceBatch:
    """The sequences a decode loop steps together, kept as arrays between steps.

    ``manager.append(seq_ids)`` resolves ids to rows and checks them for repeats on every call; a decode loop whose
    batch changes by a sequence or two per step can keep the resolved rows instead. ``step()`` appends one token to
    every member, all or nothing, like ``manager.append(members)``; slots come in member order.

    Invariants: ``seq_ids`` are distinct and ``rows[i]`` is the row of ``seq_ids[i]`` as of the last change; before
    each step one comparison (``index.hold(rows, seq_ids)``) proves every member is still live, so a member freed
    behind the batch's back raises SequenceNotFoundError instead of touching a reused row.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.seq_ids: np.ndarray = np.zeros(0, dtype=np.uint64)
        self.rows: np.ndarray = np.zeros(0, dtype=np.intp)
        self._position: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._position)

    def add(self, seq_id: int) -> None:
        if seq_id in self._position:
            raise InvalidArgumentError(f"sequence {seq_id} is already in the batch")
        row = self.manager.index.row(seq_id)
        self._position[seq_id] = self.seq_ids.size
        self.seq_ids = np.append(self.seq_ids, np.uint64(seq_id))
        self.rows = np.append(self.rows, row)

    def replace(self, old_seq_id: int, new_seq_id: int) -> None:
        """Put ``new_seq_id`` in ``old_seq_id``'s place (a finished sequence replaced by a new one)."""
        if new_seq_id in self._position:
            raise InvalidArgumentError(f"sequence {new_seq_id} is already in the batch")
        row = self.manager.index.row(new_seq_id)
        position = self._position.pop(old_seq_id)
        self._position[new_seq_id] = position
        self.seq_ids[position] = new_seq_id
        self.rows[position] = row

    def remove(self, seq_id: int) -> None:
        position = self._position.pop(seq_id)
        last = self.seq_ids.size - 1
        if position != last:  # move the last member into the hole
            moved = int(self.seq_ids[last])
            self.seq_ids[position], self.rows[position] = self.seq_ids[last], self.rows[last]
            self._position[moved] = position
        self.seq_ids, self.rows = self.seq_ids[:last].copy(), self.rows[:last].copy()

    def step(self) -> AppendPlan:
        """One token for every member; raises (changing nothing) if any member is gone or the pool is full."""
        if not self._position:
            raise InvalidArgumentError("the batch is empty")
        if not self.manager.index.hold(self.rows, self.seq_ids):
            gone = [s for s in self.seq_ids.tolist() if s not in self.manager.index]
            raise SequenceNotFoundError(f"sequence {gone[0]} of the batch is not live (freed?)")
        return self.manager.tables.plan_append(self.rows, 1)
