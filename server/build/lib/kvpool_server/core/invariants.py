"""Whole-manager checks and statistics: slow, thorough, read-only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool_server.core.block_tables import UNSET
from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.types import PoolStats

if TYPE_CHECKING:
    from kvpool_server.core.manager import KVCacheManager


def _live_blocks(manager: KVCacheManager) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, lengths, num_blocks) of every live sequence."""
    rows = manager.index.live_rows()
    lengths = manager.tables.num_tokens[rows]
    return rows, lengths, -(-lengths // manager.block_size)


def check_manager_invariants(manager: KVCacheManager) -> None:
    """Raise InvariantViolationError naming the first broken invariant of KVCacheManager (see its docstring)."""
    allocator, tables, bs = manager.allocator, manager.tables, manager.block_size
    allocator.check_invariants()
    manager.index.check_invariants()
    rows, lengths, num_blocks = _live_blocks(manager)
    if (lengths < 0).any() or (lengths > manager.max_seq_len).any():
        raise InvariantViolationError("a sequence length is negative or over max_seq_len")
    free_rows = tables.free_rows()
    if len(set(free_rows)) != len(free_rows) or set(free_rows) & set(rows.tolist()):
        raise InvariantViolationError("a row is free twice, or free and live")
    if free_rows and (
        (tables.num_tokens[free_rows] != 0).any()
        or (tables.next_slot[free_rows] != 0).any()
        or (tables.table[free_rows] != UNSET).any()
    ):
        raise InvariantViolationError("a free row still holds tokens, a next slot or blocks")
    partial = lengths % bs != 0
    rows_p, lengths_p = rows[partial], lengths[partial]
    expected_next = tables.slots(rows_p, lengths_p)
    if not np.array_equal(tables.next_slot[rows_p], expected_next):
        bad = rows_p[tables.next_slot[rows_p] != expected_next][:8]
        raise InvariantViolationError(f"next_slot disagrees with the block table at rows {bad.tolist()}")
    if len(free_rows) + rows.size != tables.num_rows:
        raise InvariantViolationError("a row is neither live nor free")
    width = np.arange(tables.max_blocks_per_seq)
    held = width[None, :] < num_blocks[:, None]
    sub = tables.table[rows]
    if (sub[held] < 0).any() or (sub[held] >= manager.num_blocks).any():
        raise InvariantViolationError("a live sequence holds an invalid block id")
    if (sub[~held] != UNSET).any():
        raise InvariantViolationError("a block table has entries past its last block")
    for row, n in zip(rows.tolist(), num_blocks.tolist()):
        if np.unique(tables.table[row, :n]).size != n:
            raise InvariantViolationError(f"row {row} holds a block twice")
    expected = np.bincount(sub[held], minlength=manager.num_blocks)
    if not np.array_equal(expected, allocator.ref_count):
        bad = np.flatnonzero(expected != allocator.ref_count)[:8]
        raise InvariantViolationError(
            f"ref counts differ from block-table references at blocks {bad.tolist()}: "
            f"counted {expected[bad].tolist()}, stored {allocator.ref_count[bad].tolist()}"
        )
    # Sharers of a block agree on its fill (tokens stored in it).
    block_ids, fills = _block_fills(manager, rows, lengths, num_blocks)
    order = np.argsort(block_ids, kind="stable")
    block_ids, fills = block_ids[order], fills[order]
    same_block = block_ids[1:] == block_ids[:-1]
    if (fills[1:][same_block] != fills[:-1][same_block]).any():
        raise InvariantViolationError("sequences sharing a block disagree on how many tokens it holds")
    if manager.num_copies < 0 or bs < 1:
        raise InvariantViolationError("negative copy count or block size")


def _block_fills(
    manager: KVCacheManager, rows: np.ndarray, lengths: np.ndarray, num_blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every (block_id, tokens in it) reference of every live sequence."""
    bs = manager.block_size
    width = np.arange(manager.tables.max_blocks_per_seq)
    held = width[None, :] < num_blocks[:, None]
    block_ids = manager.tables.table[rows][held]
    fills = np.clip(lengths[:, None] - width[None, :] * bs, 0, bs)[held]
    return block_ids, fills


def compute_stats(manager: KVCacheManager) -> PoolStats:
    allocator, bs = manager.allocator, manager.block_size
    rows, lengths, num_blocks = _live_blocks(manager)
    partial = lengths % bs != 0
    last_blocks = manager.tables.table[rows[partial], num_blocks[partial] - 1]
    last_blocks, first = np.unique(last_blocks, return_index=True)
    num_slots_unused = int((bs - lengths[partial][first] % bs).sum())
    return PoolStats(
        num_blocks_total=allocator.num_blocks,
        num_blocks_free=allocator.num_free_blocks,
        num_blocks_used=allocator.num_used_blocks,
        num_blocks_shared=int(np.count_nonzero(allocator.ref_count > 1)),
        num_tokens=int(lengths.sum()),
        num_slots_unused=num_slots_unused,
        num_copies=manager.num_copies,
        num_sequences=len(manager.index),
        block_size=bs,
    )
