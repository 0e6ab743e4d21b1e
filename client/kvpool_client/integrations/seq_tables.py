"""The engine's copy of its sequences' block tables, kept from Append replies (and, for a prompt's cached run, one
GetBlockTable at its register), never re-read from the server.

    row of a sequence:  table[row, :ceil(len / block_size)] = its block ids,  lens[row] = its tokens

An Append reply names the slot of every new token; token ``pos`` lives in block ``slot // block_size``, so the
reply names every block that changed -- a new block, or a shared last block replaced by its copy-on-write copy --
and the blocks before never move. ``apply`` writes ``table[row, pos // block_size] = slot // block_size`` for each
new token (one vectorized assignment for a whole batch). A fork copies the parent's row; a free drops the row. A
sequence registered with a prompt starts with the cached run the server gave it (``start``: its block ids).

Bounded: ``max_seqs`` rows of ``max_blocks`` int32 entries (the engine's ``max_model_len / block_size``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class SeqTables:
    """Rows for up to ``max_seqs`` sequences. Invariant (``check_invariants``): the rows in ``row_of`` are distinct
    and not free; ``lens[row] <= max_blocks * block_size``."""

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.table = np.zeros((max_seqs, max_blocks), dtype=np.int32)
        self.lens = np.zeros(max_seqs, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def add(self, seq: int) -> None:
        if not self._free_rows:
            raise RuntimeError(f"the engine tracks at most {self.table.shape[0]} sequences")
        row = self._free_rows.pop()
        self.row_of[seq] = row
        self.lens[row] = 0

    def start(self, seq: int, block_ids: np.ndarray, num_tokens: int) -> None:
        """Add ``seq`` holding ``num_tokens`` tokens in ``block_ids`` (a prompt's cached run, whole blocks)."""
        if block_ids.size > self.max_blocks or num_tokens != block_ids.size * self.block_size:
            raise ValueError(f"a run of {block_ids.size} blocks for {num_tokens} tokens does not fit a row of "
                             f"{self.max_blocks} blocks of {self.block_size}")
        self.add(seq)
        row = self.row_of[seq]
        self.table[row, :block_ids.size] = block_ids
        self.lens[row] = num_tokens

    def fork(self, parent: int, children: Sequence[int]) -> None:
        src = self.row_of[parent]
        for child in children:
            self.add(child)
            dst = self.row_of[child]
            self.table[dst] = self.table[src]
            self.lens[dst] = self.lens[src]

    def remove(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self._free_rows.append(self.row_of.pop(seq))

    def rows(self, seqs: Sequence[int]) -> np.ndarray:
        return np.fromiter((self.row_of[s] for s in seqs), dtype=np.int64, count=len(seqs))

    def apply(self, rows: np.ndarray, counts: np.ndarray, slots: np.ndarray) -> None:
        """An Append of ``counts[i]`` tokens to row ``rows[i]`` answered with ``slots`` (grouped by sequence)."""
        lens = self.lens[rows]
        if np.any(lens + counts > self.max_blocks * self.block_size):
            raise ValueError(f"a sequence would exceed the engine's {self.max_blocks * self.block_size} tokens")
        if counts.size and bool(np.all(counts == 1)):
            self.table[rows, lens // self.block_size] = slots // self.block_size
        else:
            rep = np.repeat(rows, counts)
            starts = np.repeat(np.cumsum(counts) - counts, counts)
            pos = np.repeat(lens, counts) + np.arange(rep.size) - starts
            self.table[rep, pos // self.block_size] = slots // self.block_size
        self.lens[rows] = lens + counts

    def context_slots(self, row: int) -> np.ndarray:
        """The slots of tokens [0, len) of ``row``: a prefill's context."""
        pos = np.arange(self.lens[row])
        return self.table[row, pos // self.block_size].astype(np.int64) * self.block_size + pos % self.block_size

    def check_invariants(self) -> None:
        rows = list(self.row_of.values())
        assert len(set(rows)) == len(rows) and not set(rows) & set(self._free_rows)
        assert int(self.lens.max(initial=0)) <= self.max_blocks * self.block_size
