import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError, SequenceNotFoundError
from kvpool_server.core.seq_index import MAX_CALLER_SEQ_ID, ROW_BITS, SequenceIndex, check_caller_seq_id


def test_server_ids_carry_their_row_and_never_repeat():
    index = SequenceIndex(8)
    first = index.new_server_id(3)
    second = index.new_server_id(3)
    assert first != second and first >> 63 == 1
    assert first & ((1 << ROW_BITS) - 1) == 3


def test_scalar_and_batch_lookup_agree_for_server_and_caller_ids():
    index = SequenceIndex(8)
    server_ids = [index.new_server_id(row) for row in (0, 5)]
    for seq_id, row in [(server_ids[0], 0), (server_ids[1], 5), (7, 1), (MAX_CALLER_SEQ_ID, 2)]:
        index.add(seq_id, row)
    ids = np.array([7, server_ids[1], MAX_CALLER_SEQ_ID, server_ids[0]], dtype=np.uint64)
    assert index.rows(ids).tolist() == [1, 5, 2, 0]
    assert index.rows(np.array(server_ids, dtype=np.uint64)).tolist() == [0, 5]
    assert index.row(MAX_CALLER_SEQ_ID) == 2
    index.check_invariants()


def test_stale_server_id_does_not_match_a_reused_row():
    index = SequenceIndex(4)
    old = index.new_server_id(2)
    index.add(old, 2)
    index.remove(old)
    new = index.new_server_id(2)
    index.add(new, 2)
    with pytest.raises(SequenceNotFoundError, match=f"sequence {old} is not live"):
        index.rows(np.array([new, old], dtype=np.uint64))
    with pytest.raises(SequenceNotFoundError):
        index.row(old)


def test_missing_caller_id_is_named():
    index = SequenceIndex(4)
    index.add(10, 0)
    with pytest.raises(SequenceNotFoundError, match="sequence 11 is not live"):
        index.rows(np.array([10, 11], dtype=np.uint64))
    # low bits pointing past the rows
    with pytest.raises(SequenceNotFoundError):
        index.rows(np.array([2**40 + 3], dtype=np.uint64))


def test_resize_keeps_entries():
    index = SequenceIndex(2)
    seq_id = index.new_server_id(1)
    index.add(seq_id, 1)
    index.resize(16)
    index.add(index.new_server_id(12), 12)
    assert index.rows(np.array([seq_id], dtype=np.uint64)).tolist() == [1]
    index.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2**63, 2**64 - 1])
def test_caller_seq_id_range(bad):
    with pytest.raises(InvalidArgumentError, match="2\\*\\*63"):
        check_caller_seq_id(bad)
