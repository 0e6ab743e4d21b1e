"""BlockTables: the page table of every live sequence, as one NumPy matrix."""

from __future__ import annotations

import numpy as np

from kvpool_server.core.errors import OutOfBlocksError

UNSET = -1


class BlockTables:
    """One row per live sequence: ``table[row, i]`` is the physical block of logical block i.

    A sequence with n tokens holds ``ceil(n / block_size)`` blocks; token at position p lives in logical block
    ``p // block_size`` at offset ``p % block_size``. Entries past a row's last block are UNSET (-1). Keeping the
    tables and token counts as arrays lets a batched append read and write every sequence with a few NumPy
    operations (the layout vLLM's InputBatch uses for its block table)::

        row 3:  [ 17 | 4 | 9 | -1 | -1 ...]   num_tokens[3] = 37, next_slot[3] = 9 * 16 + 5, block_size 16
                  0-15 16-31 32-36 (11 free slots in block 9)

    ``next_slot[row]`` caches the slot the row's next token goes to while its last block has room, so that a decode
    step reads one number per sequence instead of recomputing it from the table. Lookups indexed by a length
    (``starts_block``, ``block_index``, ``offset``, ``at_limit``) replace arithmetic on whole batches with one gather each.

    Rows are reused after a sequence is freed; the arrays double when they run out, up to ``max_num_seqs`` rows.

    Invariants: a live row with n tokens, ``n % block_size != 0``, has
    ``next_slot == table[row, n // block_size] * block_size + n % block_size``; a free row has ``num_tokens == 0``,
    ``next_slot == 0`` and is all UNSET; rows on the free list are distinct.
    """

    def __init__(self, block_size: int, max_seq_len: int, max_num_seqs: int, initial_rows: int = 64) -> None:
        self.block_size: int = block_size
        self.max_seq_len: int = max_seq_len
        self.max_blocks_per_seq: int = -(-max_seq_len // block_size)
        self.max_num_seqs: int = max_num_seqs
        rows = min(initial_rows, max_num_seqs)
        self.table: np.ndarray = np.full((rows, self.max_blocks_per_seq), UNSET, dtype=np.int32)
        self.num_tokens: np.ndarray = np.zeros(rows, dtype=np.int64)
        self.next_slot: np.ndarray = np.zeros(rows, dtype=np.int64)
        self._free_rows: list[int] = list(range(rows - 1, -1, -1))
        # Indexed by a length (or position) n in [0, max_seq_len]: does token n open a block, its block and offset,
        # is n at the limit. int64 (intp), the dtype NumPy indexes with: narrower lookups cost a cast per call.
        # 18 bytes per token of max_seq_len (576 KiB for the default 32768).
        lengths = np.arange(max_seq_len + 1, dtype=np.int64)
        self.starts_block: np.ndarray = lengths % block_size == 0
        self.block_index: np.ndarray = lengths // block_size
        self.offset: np.ndarray = lengths % block_size
        self.at_limit: np.ndarray = lengths >= max_seq_len

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
        self.next_slot[row] = 0
        self._free_rows.append(row)

    def _grow(self) -> None:
        old = self.num_rows
        new = min(old * 2, self.max_num_seqs)
        table = np.full((new, self.max_blocks_per_seq), UNSET, dtype=np.int32)
        table[:old] = self.table
        num_tokens, next_slot = np.zeros(new, dtype=np.int64), np.zeros(new, dtype=np.int64)
        num_tokens[:old], next_slot[:old] = self.num_tokens, self.next_slot
        self.table, self.num_tokens, self.next_slot = table, num_tokens, next_slot
        self._free_rows[:0] = range(new - 1, old - 1, -1)

    def slots(self, rows: np.ndarray | int, positions: np.ndarray) -> np.ndarray:
        """The slot (int64) of token ``positions[i]`` of row ``rows[i]`` (or of one row): its block * block_size +
        its offset. The positions must lie in blocks the rows hold."""
        bs = self.block_size
        return self.table[rows, positions // bs].astype(np.int64) * bs + positions % bs

    def free_rows(self) -> list[int]:
        return list(self._free_rows)
