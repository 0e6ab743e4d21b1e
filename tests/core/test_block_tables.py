import numpy as np
import pytest

from kvpool_server.core import BlockAllocator, OutOfBlocksError, block_tables
from kvpool_server.core.block_tables import UNSET, BlockTables
from kvpool_server.core.checks import check_block_tables


def make_tables(max_num_seqs: int = 10, initial_rows: int = 2, block_size: int = 4, max_seq_len: int = 16):
    return BlockTables(block_size, max_seq_len, max_num_seqs, BlockAllocator(32), initial_rows=initial_rows)


def test_rows_grow_and_are_reused():
    tables = make_tables()
    rows = tables.acquire_rows(5)
    assert len(set(rows)) == 5 and tables.num_rows >= 5
    tables.plan_append(np.array([rows[0]]), 3)
    assert tables.release([rows[0]]) == 1
    assert tables.num_tokens[rows[0]] == 0 and tables.next_slot[rows[0]] == 0
    assert (tables.table[rows[0]] == UNSET).all()
    assert rows[0] in tables.acquire_rows(1)
    check_block_tables(tables)


def test_max_num_seqs_is_a_hard_cap():
    tables = make_tables(max_num_seqs=3)
    tables.acquire_rows(3)
    with pytest.raises(OutOfBlocksError, match="max_num_seqs=3"):
        tables.acquire_rows(1)
    assert tables.num_live_rows() == 3


def test_growing_keeps_every_row():
    tables = make_tables()
    first = tables.acquire_rows(2)
    tables.plan_append(np.array([first[1]]), 6)
    blocks, next_slot = tables.table[first[1], :2].tolist(), int(tables.next_slot[first[1]])
    tables.acquire_rows(3)  # grows 2 -> 4 -> 8 rows
    assert tables.num_rows == 8 and tables.num_live_rows() == 5
    assert tables.table[first[1], :3].tolist() == [*blocks, UNSET]
    assert (tables.num_tokens[first[1]], tables.next_slot[first[1]]) == (6, next_slot)
    check_block_tables(tables)


def test_fork_shares_and_release_returns_only_unshared_blocks():
    tables = make_tables()
    parent, child = tables.acquire_rows(2)
    tables.plan_append(np.array([parent]), 5)
    tables.fork(parent, [child])
    assert tables.table[child, :2].tolist() == tables.table[parent, :2].tolist()
    assert tables.release([parent]) == 0 and tables.release([child]) == 2
    assert tables.allocator.num_free_blocks == 32
    check_block_tables(tables)


@pytest.mark.parametrize("block_size, max_seq_len", [(4, 16), (16, 50), (3, 10)])
def test_length_lookups_match_the_arithmetic(block_size, max_seq_len):
    tables = make_tables(max_num_seqs=2, block_size=block_size, max_seq_len=max_seq_len)
    lookup = tables.by_length
    for n in range(max_seq_len + 1):
        assert lookup.starts_block[n] == (n % block_size == 0)
        assert (lookup.block_index[n], lookup.offset[n]) == divmod(n, block_size)
        assert lookup.num_blocks[n] == tables.blocks_for(n) == -(-n // block_size)
        assert lookup.at_limit[n] == (n >= max_seq_len)
    assert tables.max_blocks_per_seq == tables.blocks_for(max_seq_len)


def test_the_three_planners_agree():
    """Decode step, one-row and general paths: the same slots, blocks and counts for the same appends."""
    shapes = [([0, 1, 2], 1), ([1], 5), ([0, 2], np.array([3, 6])), ([2, 0, 1], 1), ([0], 1), ([1, 2], 4)]
    fast, general = make_tables(max_seq_len=64), make_tables(max_seq_len=64)
    for tables in (fast, general):
        tables.acquire_rows(3)
    for rows, counts in shapes:
        rows = np.array(rows)
        a = fast.plan_append(rows, counts)
        b = general._plan_general(rows, counts)
        assert a.slot_mapping.tolist() == b.slot_mapping.tolist()
        assert a.new_block_ids.tolist() == b.new_block_ids.tolist()
        assert np.array_equal(fast.table, general.table) and np.array_equal(fast.next_slot, general.next_slot)
    check_block_tables(fast)
    check_block_tables(general)


@pytest.mark.parametrize("scratch_blocks", [4, block_tables.SCRATCH_BLOCKS])
@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_run_slots_are_the_slots_of_every_token_of_each_run(block_size, scratch_blocks, monkeypatch):
    """The per-block expansion (each touched block whole, then each run's head and tail trimmed) gives the slots
    ``slots()`` defines token by token, and each row's next slot; through the general planner too; whether the
    runs fit the kept scratch or not."""
    monkeypatch.setattr(block_tables, "SCRATCH_BLOCKS", scratch_blocks)
    rng = np.random.default_rng(block_size)
    tables = BlockTables(block_size, 200, 12, BlockAllocator(4096))
    rows = np.array(tables.acquire_rows(12))
    for _ in range(25):
        chosen = rows[np.sort(rng.choice(rows.size, size=int(rng.integers(1, rows.size + 1)), replace=False))]
        counts = rng.integers(1, 12, size=chosen.size)
        if (tables.num_tokens[chosen] + counts).max() > 200:
            break
        lengths = tables.num_tokens[chosen].copy()
        plan = tables._plan_general(chosen, counts)
        expected = np.concatenate([tables.slots(int(r), slice(n, n + c)) for r, n, c in zip(chosen, lengths, counts)])
        slots, next_slots = tables.run_slots(chosen, lengths, lengths + counts)
        assert slots.tolist() == expected.tolist() == plan.slot_mapping.tolist()
        assert next_slots.tolist() == (expected[np.cumsum(counts) - 1] + 1).tolist()
    check_block_tables(tables)
