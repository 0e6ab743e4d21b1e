"""BlockTables: the page table of every live sequence, as one NumPy matrix."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.errors import OutOfBlocksError

UNSET = -1


class BlockTables:
    """One row per live sequence: ``table[row, i]`` is the physical block of logical block i.

    A sequence with n tokens holds ``ceil(n / block_size)`` blocks; token at position p lives in logical block
    ``p // block_size`` at offset ``p % block_size``. Entries past a row's last block are UNSET (-1). Keeping the
    tables and token counts as matrices lets a batched append read and write every sequence with a few NumPy
    operations (the layout vLLM's InputBatch uses for its block table)::

        row 3:  [ 17 | 4 | 9 | -1 | -1 ...]   num_tokens[3] = 37, block_size 16
                  0-15 16-31 32-36 (11 free slots in block 9)

    Rows are reused after a sequence is freed; the matrix doubles when it runs out, up to ``max_num_seqs`` rows.

    Invariants: a free row has ``num_tokens == 0`` and is all UNSET; rows on the free list are distinct.
    """

    def __init__(self, max_blocks_per_seq: int, max_num_seqs: int, initial_rows: int = 64) -> None:
        self.max_blocks_per_seq: int = max_blocks_per_seq
        self.max_num_seqs: int = max_num_seqs
        rows = min(initial_rows, max_num_seqs)
        self.table: np.ndarray = np.full((rows, max_blocks_per_seq), UNSET, dtype=np.int32)
        self.num_tokens: np.ndarray = np.zeros(rows, dtype=np.int64)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return self.table.shape[0]

    def num_live_rows(self) -> int:
        return self.num_rows - len(self._free_rows)

    def can_acquire(self, num: int) -> bool:
        return self.num_live_rows() + num <= self.max_num_seqs

    def acquire_rows(self, num: int) -> list[int]:
        if not self.can_acquire(num):
            raise OutOfBlocksError(
                f"{num} more sequences would exceed max_num_seqs={self.max_num_seqs} "
                f"({self.num_live_rows()} are live)"
            )
        while len(self._free_rows) < num:
            self._grow()
        return [self._free_rows.pop() for _ in range(num)]

    def acquire_row(self) -> int:
        if self._free_rows:
            return self._free_rows.pop()
        return self.acquire_rows(1)[0]

    def release_row(self, row: int) -> None:
        self.table[row] = UNSET
        self.num_tokens[row] = 0
        self._free_rows.append(row)

    def _grow(self) -> None:
        old = self.num_rows
        new = min(old * 2, self.max_num_seqs)
        table = np.full((new, self.max_blocks_per_seq), UNSET, dtype=np.int32)
        table[:old] = self.table
        num_tokens = np.zeros(new, dtype=np.int64)
        num_tokens[:old] = self.num_tokens
        self.table, self.num_tokens = table, num_tokens
        self._free_rows[:0] = range(new - 1, old - 1, -1)

    def free_rows(self) -> list[int]:
        return list(self._free_rows)
