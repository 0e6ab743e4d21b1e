import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError, SequenceNotFoundError
from kvpool_server.core.seq_index import MAX_SEQ_ID, SequenceIndex, check_seq_id


def test_scalar_and_batch_lookup_agree():
    index = SequenceIndex()
    for seq_id, row in [(5, 0), (2**63 + 7, 1), (1, 2), (MAX_SEQ_ID, 3)]:
        index.add(seq_id, row)
    ids = np.array([1, MAX_SEQ_ID, 5, 2**63 + 7], dtype=np.uint64)
    assert index.rows(ids).tolist() == [2, 3, 0, 1]
    assert index.row(2**63 + 7) == 1
    index.check_invariants()


def test_missing_id_is_named():
    index = SequenceIndex()
    index.add(10, 0)
    with pytest.raises(SequenceNotFoundError, match="sequence 11 is not live"):
        index.rows(np.array([10, 11], dtype=np.uint64))
    with pytest.raises(SequenceNotFoundError, match="sequence 2"):
        index.row(2)
    # larger than every live id: lands on the sentinel
    with pytest.raises(SequenceNotFoundError):
        index.rows(np.array([MAX_SEQ_ID], dtype=np.uint64))


def test_assigned_ids_are_never_reused_and_skip_caller_ids():
    index = SequenceIndex()
    index.add(2, 0)
    first = index.next_seq_id()
    index.add(first, 1)
    index.remove([first])
    second = index.next_seq_id()
    assert first == 1 and second == 3  # 2 belongs to a caller; 1 is not handed out again
    index.check_invariants()


def test_remove_keeps_index_consistent():
    index = SequenceIndex()
    for i in range(1, 20):
        index.add(i * 3, i)
    index.remove([3, 30, 57])
    assert len(index) == 16 and 30 not in index
    index.check_invariants()


@pytest.mark.parametrize("bad", [0, -1, 2**64 - 1, 2**64])
def test_seq_id_range(bad):
    with pytest.raises(InvalidArgumentError):
        check_seq_id(bad)
