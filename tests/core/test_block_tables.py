import pytest

from kvpool_server.core import OutOfBlocksError
from kvpool_server.core.block_tables import UNSET, BlockTables


def test_rows_grow_and_are_reused():
    tables = BlockTables(block_size=4, max_seq_len=16, max_num_seqs=10, initial_rows=2)
    rows = tables.acquire_rows(5)
    assert len(set(rows)) == 5 and tables.num_rows >= 5
    tables.table[rows[0], 0] = 7
    tables.num_tokens[rows[0]] = 3
    tables.next_slot[rows[0]] = 7 * 4 + 3
    tables.release_row(rows[0])
    assert tables.num_tokens[rows[0]] == 0 and tables.next_slot[rows[0]] == 0
    assert (tables.table[rows[0]] == UNSET).all()
    assert rows[0] in tables.acquire_rows(1)


def test_max_num_seqs_is_a_hard_cap():
    tables = BlockTables(block_size=4, max_seq_len=16, max_num_seqs=3, initial_rows=2)
    tables.acquire_rows(3)
    with pytest.raises(OutOfBlocksError, match="max_num_seqs=3"):
        tables.acquire_rows(1)
    assert tables.num_live_rows() == 3


def test_growing_keeps_every_row():
    tables = BlockTables(block_size=4, max_seq_len=16, max_num_seqs=10, initial_rows=2)
    first = tables.acquire_rows(2)
    tables.table[first[1], :2] = [5, 6]
    tables.num_tokens[first[1]], tables.next_slot[first[1]] = 6, 6 * 4 + 2
    tables.acquire_rows(3)  # grows 2 -> 4 -> 8 rows
    assert tables.num_rows == 8 and tables.num_live_rows() == 5
    assert tables.table[first[1], :3].tolist() == [5, 6, UNSET]
    assert (tables.num_tokens[first[1]], tables.next_slot[first[1]]) == (6, 26)


@pytest.mark.parametrize("block_size, max_seq_len", [(4, 16), (16, 50), (3, 10)])
def test_length_lookups_match_the_arithmetic(block_size, max_seq_len):
    tables = BlockTables(block_size=block_size, max_seq_len=max_seq_len, max_num_seqs=2)
    for n in range(max_seq_len + 1):
        assert tables.starts_block[n] == (n % block_size == 0)
        assert tables.block_index[n] == n // block_size
        assert tables.at_limit[n] == (n >= max_seq_len)
    assert tables.max_blocks_per_seq == -(-max_seq_len // block_size)
