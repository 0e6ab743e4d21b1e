"""checks.py: each check of check_block_tables and of the manager-level check_invariants fires on the state it
guards (the allocator's and the index's checks are shown in their own test files)."""

import pytest

from kvpool_server.core import InvariantViolationError, KVCacheManager
from kvpool_server.core.checks import check_block_tables


def with_sequences() -> tuple[KVCacheManager, int, int, int]:
    """A manager with a parent of 5 tokens (2 blocks, the second partly filled and shared) and its forked child.

    Returns (manager, parent row, child row, a free row)."""
    manager = KVCacheManager(num_blocks=16, block_size=4, max_seq_len=40)
    parent = manager.register()
    manager.append(parent, 5)
    (child,) = manager.fork(parent, 1)
    manager.check_invariants()
    free_row = manager.tables.free_rows()[-1]
    return manager, manager.index.row(parent), manager.index.row(child), free_row


def set_length(manager: KVCacheManager, row: int, length: int) -> None:
    manager.tables.num_tokens[row] = length


def hold_one_more_reference(manager: KVCacheManager, block_id: int) -> None:
    """A ref count one above the table's references, the allocator's own bookkeeping kept consistent."""
    allocator = manager.allocator
    allocator.num_shared_blocks += int(allocator.ref_count[block_id] == 1)
    allocator.ref_count[block_id] += 1


def grow_without_moving_next_slot(manager: KVCacheManager, row: int) -> None:
    """The child claims a 6th token in the shared block (next_slot kept right), so it and the parent disagree on
    the block's fill."""
    tables = manager.tables
    tables.num_tokens[row] = 6
    tables.next_slot[row] = tables.slots(row, slice(6, 7))[0]


TABLE_CHECKS = [
    (lambda m, p, c, f: m.tables._free_rows.append(f), "a row is on the free list twice"),
    (lambda m, p, c, f: set_length(m, f, 3), "a free row still holds tokens, a next slot or blocks"),
    (lambda m, p, c, f: set_length(m, p, 41), "a sequence length is negative or over max_seq_len"),
    (lambda m, p, c, f: m.tables.table.__setitem__((p, 0), 16), "a live sequence holds an invalid block id"),
    (lambda m, p, c, f: m.tables.table.__setitem__((p, 2), 9), "a block table has entries past its last block"),
    (lambda m, p, c, f: m.tables.table.__setitem__((p, 1), m.tables.table[p, 0]), "holds a block twice"),
    (lambda m, p, c, f: m.tables.next_slot.__setitem__(p, m.tables.next_slot[p] + 1), "next_slot disagrees"),
    (lambda m, p, c, f: hold_one_more_reference(m, m.tables.table[p, 0]), "ref counts differ from block-table"),
    (lambda m, p, c, f: grow_without_moving_next_slot(m, c), "sequences sharing a block disagree"),
    (lambda m, p, c, f: setattr(m.tables, "num_copies", -1), "negative copy count -1"),
    (lambda m, p, c, f: setattr(m.tables, "num_tokens_appended", -1), "negative appended-token count -1"),
]


@pytest.mark.parametrize("corrupt, message", TABLE_CHECKS)
def test_each_check_of_the_block_tables_fires(corrupt, message):
    manager, parent_row, child_row, free_row = with_sequences()
    corrupt(manager, parent_row, child_row, free_row)
    with pytest.raises(InvariantViolationError, match=message):
        check_block_tables(manager.tables)
    with pytest.raises(InvariantViolationError, match=message):
        manager.check_invariants()


def test_the_block_tables_check_runs_the_allocators():
    manager, *_ = with_sequences()
    manager.allocator.num_shared_blocks += 1
    with pytest.raises(InvariantViolationError, match="num_shared_blocks"):
        check_block_tables(manager.tables)


def test_the_manager_check_fires_on_a_row_in_use_that_no_sequence_holds():
    manager, *_ = with_sequences()
    leaked = manager.tables.acquire_row()
    check_block_tables(manager.tables)  # the tables alone are consistent
    with pytest.raises(InvariantViolationError, match=rf"names rows \[{leaked}\] differently from the tables"):
        manager.check_invariants()


def test_the_manager_check_runs_the_indexs():
    manager, parent_row, *_ = with_sequences()
    manager.index.row_to_id[parent_row] += 1
    with pytest.raises(InvariantViolationError, match="the id dict and row_to_id disagree"):
        manager.check_invariants()
