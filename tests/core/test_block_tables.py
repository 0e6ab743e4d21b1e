import pytest

from kvpool_server.core import OutOfBlocksError
from kvpool_server.core.block_tables import UNSET, BlockTables


def test_rows_grow_and_are_reused():
    tables = BlockTables(max_blocks_per_seq=4, max_num_seqs=10, initial_rows=2)
    rows = tables.acquire_rows(5)
    assert len(set(rows)) == 5 and tables.num_rows >= 5
    tables.table[rows[0], 0] = 7
    tables.num_tokens[rows[0]] = 3
    tables.release_row(rows[0])
    assert tables.num_tokens[rows[0]] == 0 and (tables.table[rows[0]] == UNSET).all()
    assert rows[0] in tables.acquire_rows(1)


def test_max_num_seqs_is_a_hard_cap():
    tables = BlockTables(max_blocks_per_seq=4, max_num_seqs=3, initial_rows=2)
    tables.acquire_rows(3)
    with pytest.raises(OutOfBlocksError, match="max_num_seqs=3"):
        tables.acquire_rows(1)
    assert tables.num_live_rows() == 3
