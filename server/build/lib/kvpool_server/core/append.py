"""Planning a batched append: the vectorised heart of the manager.

Both planners check everything (length limits, free blocks) before they change anything, so a batch that cannot be
served in full changes nothing. They assume ``rows`` are distinct live rows (the manager checks that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvpool_server.core.errors import InvalidArgumentError
from kvpool_server.core.types import EMPTY_BLOCKS, NO_COPIES, AppendPlan

# A 0-d array, not a Python int: NumPy adds it to an array faster (no scalar conversion per call).
ONE = np.array(1, dtype=np.int64)
ONE.flags.writeable = False

if TYPE_CHECKING:
    from kvpool_server.core.manager import KVCacheManager


def plan_append_one_each(manager: KVCacheManager, rows: np.ndarray) -> AppendPlan | None:
    """One token for each row: the decode step. Returns None when a row needs copy-on-write (the general path).

    Written for NumPy's per-call cost, which is most of a step's cost at these sizes: gathers (``take``) through
    the tables' per-length lookups instead of arithmetic on the whole batch, and a reduction only where one is
    unavoidable (``count_nonzero``, the cheapest).
    """
    tables, allocator = manager.tables, manager.allocator
    lengths = tables.num_tokens.take(rows)
    if np.count_nonzero(tables.at_limit.take(lengths)):
        raise _too_long(manager, lengths + 1)
    if allocator.num_shared_blocks:
        # The block each row writes into; UNSET (-1, whose padded ref count is 0) where a new block starts.
        current = tables.table[rows, tables.block_index.take(lengths)]
        if np.count_nonzero(allocator.ref_count_padded.take(current) > 1):
            return None
    slots = tables.next_slot.take(rows)
    opening = tables.starts_block.take(lengths).nonzero()[0]
    if opening.size:
        new_blocks = allocator.allocate(opening.size)  # raises OutOfBlocksError before any change
        tables.table[rows.take(opening), tables.block_index.take(lengths.take(opening))] = new_blocks
        slots[opening] = new_blocks * manager.block_size_array
    else:
        new_blocks = EMPTY_BLOCKS
    tables.next_slot[rows] = slots + ONE
    tables.num_tokens[rows] = lengths + ONE
    return AppendPlan(slots, new_blocks, NO_COPIES)


def plan_append_general(manager: KVCacheManager, rows: np.ndarray, counts: np.ndarray) -> AppendPlan:
    """``counts[i] >= 1`` tokens for ``rows[i]``, with copy-on-write of shared, partly filled last blocks.

    Copy-on-write follows the sequential rule: of the sharers of a block that append in this batch, each copies the
    block while others still reference it; if every sharer of the block is in the batch, the last of them (in batch
    order) finds itself the only owner and writes in place. So k sharers appending together make k - 1 copies.
    """
    tables, allocator, bs = manager.tables, manager.allocator, manager.block_size
    table = tables.table
    lengths = tables.num_tokens[rows]
    new_lengths = lengths + counts
    if new_lengths.max() > manager.max_seq_len:
        raise _too_long(manager, new_lengths)
    old_num_blocks = -(-lengths // bs)
    grow = -(-new_lengths // bs) - old_num_blocks

    # Copy-on-write: rows whose last block is partly filled and shared.
    partial = lengths % bs != 0
    last_index = np.maximum(old_num_blocks - 1, 0)
    last_block = np.where(partial, table[rows, last_index], -1)
    cow_pos = np.flatnonzero(allocator.ref_count_padded[last_block] > 1)
    if cow_pos.size:
        cow_pos = _drop_last_owners(cow_pos, last_block, allocator.ref_count)

    num_grow = int(grow.sum())
    new_blocks = allocator.allocate(cow_pos.size + num_grow)  # raises OutOfBlocksError before any change

    # --- from here on nothing can fail ---
    copies = NO_COPIES
    if cow_pos.size:
        src = last_block[cow_pos]
        dst = new_blocks[: cow_pos.size]
        allocator.decref(src)  # frees nothing: another sharer keeps each src
        table[rows[cow_pos], last_index[cow_pos]] = dst
        copies = np.stack([src.astype(np.int32), dst], axis=1)
    if num_grow:
        grow_rows = np.repeat(rows, grow)
        first = np.repeat(old_num_blocks - (np.cumsum(grow) - grow), grow)
        table[grow_rows, first + np.arange(num_grow)] = new_blocks[cow_pos.size :]
    tables.num_tokens[rows] = new_lengths
    _set_next_slots(manager, rows, new_lengths)

    num_new_tokens = int(counts.sum())
    starts = np.cumsum(counts) - counts
    positions = np.repeat(lengths - starts, counts) + np.arange(num_new_tokens)
    return AppendPlan(tables.slots(np.repeat(rows, counts), positions), new_blocks, copies)


def _set_next_slots(manager: KVCacheManager, rows: np.ndarray, lengths: np.ndarray) -> None:
    """Recompute ``next_slot`` of rows that now hold ``lengths`` tokens (only partly filled last blocks need it)."""
    partial = lengths % manager.block_size != 0
    rows, lengths = rows[partial], lengths[partial]
    manager.tables.next_slot[rows] = manager.tables.slots(rows, lengths)


def _drop_last_owners(cow_pos: np.ndarray, last_block: np.ndarray, ref_count: np.ndarray) -> np.ndarray:
    """Remove, for each shared block whose every sharer is in the batch, its last sharer from the copy list."""
    blocks = last_block[cow_pos]
    unique, counts = np.unique(blocks, return_counts=True)
    whole = unique[counts == ref_count[unique]]
    if whole.size == 0:
        return cow_pos
    keep = np.ones(cow_pos.size, dtype=bool)
    for block_id in whole.tolist():
        keep[np.flatnonzero(blocks == block_id)[-1]] = False
    return cow_pos[keep]


def _too_long(manager: KVCacheManager, new_lengths: np.ndarray) -> InvalidArgumentError:
    worst = int(np.argmax(new_lengths))
    return InvalidArgumentError(
        f"append would grow a sequence to {int(new_lengths[worst])} tokens, over max_seq_len={manager.max_seq_len}"
    )
