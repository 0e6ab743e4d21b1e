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

    def extend(self, seq_ids: np.ndarray) -> None:
        """Add many sequences at once (distinct uint64 ids, none in the batch yet): one resolve, one concatenate."""
        ids = np.asarray(seq_ids, dtype=np.uint64)
        id_list = ids.tolist()
        if len(set(id_list)) != len(id_list) or any(s in self._position for s in id_list):
            raise InvalidArgumentError("a sequence is repeated or already in the batch")
        rows = np.atleast_1d(np.asarray(self.manager.index.resolve(ids), dtype=np.intp))
        start = self.seq_ids.size
        self._position.update(zip(id_list, range(start, start + len(id_list))))
        self.seq_ids = np.concatenate((self.seq_ids, ids))
        self.rows = np.concatenate((self.rows, rows))

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

    def step(self, token_ids: np.ndarray | None = None) -> AppendPlan:
        """One token for every member; raises (changing nothing) if any member is gone or the pool is full.

        ``token_ids``: the members' tokens, in member order (prefix caching: the tokens join the members' chains,
        as ``manager.append(members, token_ids=...)`` does); needed once any member is tracked."""
        if not self._position:
            raise InvalidArgumentError("the batch is empty")
        if not self.manager.index.hold(self.rows, self.seq_ids):
            gone = [s for s in self.seq_ids.tolist() if s not in self.manager.index]
            raise SequenceNotFoundError(f"sequence {gone[0]} of the batch is not live (freed?)")
        if token_ids is None and not self.manager.chains.chains:
            return self.manager.tables.plan_append(self.rows, 1)
        return self.manager._append_tracked(self.seq_ids, self.rows, 1, None, token_ids)
