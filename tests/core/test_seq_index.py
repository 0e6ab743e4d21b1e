import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError, SequenceNotFoundError
from kvpool_server.core.seq_index import MAX_SEQ_ID, SequenceIndex, check_caller_seq_id


def test_server_ids_carry_their_row_never_repeat_and_stay_short():
    index = SequenceIndex(8, max_rows=4096)
    first = index.new_server_id(3)
    second = index.new_server_id(3)
    assert first != second
    assert first & ((1 << index.row_bits) - 1) == 3 and index.row_bits == 12
    assert first < 2**32  # a short varint on the wire


def test_server_ids_skip_an_id_a_caller_holds():
    index = SequenceIndex(8, max_rows=8)
    taken = (1 << index.row_bits) | 5  # what the first server id for row 5 would be
    index.add(taken, 0)
    assert index.new_server_id(5) != taken


def test_scalar_and_batch_lookup_agree_for_server_and_caller_ids():
    index = SequenceIndex(8, max_rows=8)
    server_ids = [index.new_server_id(row) for row in (0, 5)]
    for seq_id, row in [(server_ids[0], 0), (server_ids[1], 5), (7, 1), (MAX_SEQ_ID, 2)]:
        index.add(seq_id, row)
    ids = np.array([7, server_ids[1], MAX_SEQ_ID, server_ids[0]], dtype=np.uint64)
    assert index.rows(ids).tolist() == [1, 5, 2, 0]
    assert index.rows(np.array(server_ids, dtype=np.uint64)).tolist() == [0, 5]
    assert index.row(MAX_SEQ_ID) == 2
    index.check_invariants()


def test_stale_server_id_does_not_match_a_reused_row():
    index = SequenceIndex(4, max_rows=4)
    old = index.new_server_id(2)
    index.add(old, 2)
    index.remove(old)
    new = index.new_server_id(2)
    index.add(new, 2)
    with pytest.raises(SequenceNotFoundError, match=f"sequence {old} is not live"):
        index.rows(np.array([new, old], dtype=np.uint64))
    with pytest.raises(SequenceNotFoundError):
        index.row(old)


def test_zero_never_matches_a_free_row():
    index = SequenceIndex(4, max_rows=4)
    index.add(index.new_server_id(1), 1)  # row 0 stays free: row_to_id[0] == 0
    with pytest.raises(SequenceNotFoundError, match="sequence 0"):
        index.rows(np.array([0], dtype=np.uint64))


def test_missing_caller_id_is_named():
    index = SequenceIndex(4, max_rows=4)
    index.add(10, 0)
    with pytest.raises(SequenceNotFoundError, match="sequence 11 is not live"):
        index.rows(np.array([10, 11], dtype=np.uint64))
    with pytest.raises(SequenceNotFoundError):  # low bits pointing past the rows
        index.rows(np.array([2**40 + 3], dtype=np.uint64))


def test_resize_keeps_entries():
    index = SequenceIndex(2, max_rows=16)
    seq_id = index.new_server_id(1)
    index.add(seq_id, 1)
    index.resize(16)
    index.add(index.new_server_id(12), 12)
    assert index.rows(np.array([seq_id], dtype=np.uint64)).tolist() == [1]
    index.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2**64 - 1, 2**64])
def test_caller_seq_id_range(bad):
    with pytest.raises(InvalidArgumentError, match="0 means unset"):
        check_caller_seq_id(bad)
