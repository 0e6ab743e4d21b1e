import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError, InvariantViolationError, SequenceNotFoundError
from kvpool_server.core.seq_index import MAX_SEQ_ID, SequenceIndex, check_caller_seq_id


def test_server_ids_carry_their_row_never_repeat_and_fit():
    index = SequenceIndex(max_rows=4096)
    first = index.new_server_id(3)
    second = index.new_server_id(3)
    assert first != second
    assert first & ((1 << index.row_bits) - 1) == 3 and index.row_bits == 12
    assert 0 < first < 2**62 <= MAX_SEQ_ID  # room to count up for ever


def test_a_restarted_index_does_not_hand_out_the_ids_of_an_earlier_start():
    """Each start draws its serial's start at random: two starts' first ids differ (and are far apart)."""
    firsts = {SequenceIndex(max_rows=4096).new_server_id(0) for _ in range(20)}
    assert len(firsts) == 20
    assert min(abs(a - b) for a in firsts for b in firsts if a != b) > 2**20


def test_server_ids_skip_an_id_a_caller_holds():
    index = SequenceIndex(max_rows=8)
    taken = (index._next_serial << index.row_bits) | 5  # what the next server id for row 5 would be
    index.add(taken, 0)
    assert index.new_server_id(5) != taken


def test_scalar_and_batch_lookup_agree_for_server_and_caller_ids():
    index = SequenceIndex(max_rows=8)
    server_ids = [index.new_server_id(row) for row in (0, 5)]
    for seq_id, row in [(server_ids[0], 0), (server_ids[1], 5), (7, 1), (MAX_SEQ_ID, 2)]:
        index.add(seq_id, row)
    ids = np.array([7, server_ids[1], MAX_SEQ_ID, server_ids[0]], dtype=np.uint64)
    assert index.rows(ids).tolist() == [1, 5, 2, 0]
    assert index.rows(np.array(server_ids, dtype=np.uint64)).tolist() == [0, 5]
    assert index.row(MAX_SEQ_ID) == 2
    index.check_invariants()


def test_stale_server_id_does_not_match_a_reused_row():
    index = SequenceIndex(max_rows=4)
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
    index = SequenceIndex(max_rows=4)
    index.add(index.new_server_id(1), 1)  # rows 0, 2 and 3 stay free
    with pytest.raises(SequenceNotFoundError, match="sequence 0"):
        index.rows(np.array([0], dtype=np.uint64))


@pytest.mark.parametrize("max_rows", [4, 5, 8])
def test_no_value_matches_a_free_row(max_rows):
    index = SequenceIndex(max_rows=max_rows)
    index.add(index.new_server_id(1), 1)
    size = index.row_to_id.size
    candidates = list(range(2 * size)) + [2**64 - 1, 2**64 - 2, 2**63]
    for value in candidates:
        if value not in index:
            with pytest.raises(SequenceNotFoundError):
                index.rows(np.array([value], dtype=np.uint64))
    index.check_invariants()


def test_max_rows_is_checked():
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        SequenceIndex(max_rows=0)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        SequenceIndex(max_rows=(1 << 20) + 1)


def test_missing_caller_id_is_named():
    index = SequenceIndex(max_rows=4)
    index.add(10, 0)
    with pytest.raises(SequenceNotFoundError, match="sequence 11 is not live"):
        index.rows(np.array([10, 11], dtype=np.uint64))
    with pytest.raises(SequenceNotFoundError):  # low bits pointing past the rows
        index.rows(np.array([2**40 + 3], dtype=np.uint64))


def test_every_row_of_the_id_space_resolves_without_resizing():
    index = SequenceIndex(max_rows=16)
    ids = [index.new_server_id(row) for row in (1, 12, 15)]
    for seq_id, row in zip(ids, (1, 12, 15)):
        index.add(seq_id, row)
    assert index.rows(np.array(ids[::-1], dtype=np.uint64)).tolist() == [15, 12, 1]
    index.check_invariants()
    index.remove(ids[1])
    index.check_invariants()
    with pytest.raises(SequenceNotFoundError):
        index.rows(np.array([ids[1]], dtype=np.uint64))


@pytest.mark.parametrize("bad", [0, -1, 2**64 - 1, 2**64])
def test_caller_seq_id_range(bad):
    with pytest.raises(InvalidArgumentError, match="0 means unset"):
        check_caller_seq_id(bad)


@pytest.mark.parametrize("row, value", [(1, 12345), (2, 0)])  # a live row naming another id; a free row matching 0
def test_check_invariants_fires_when_the_dict_and_row_to_id_disagree(row, value):
    index = SequenceIndex(max_rows=4)
    index.add(index.new_server_id(1), 1)
    index.check_invariants()
    index.row_to_id[row] = value
    with pytest.raises(InvariantViolationError, match="the id dict and row_to_id disagree"):
        index.check_invariants()


def test_a_repeated_id_is_refused():
    index = SequenceIndex(max_rows=4)
    ids = [index.new_server_id(row) for row in (0, 1)]
    for seq_id, row in zip(ids, (0, 1)):
        index.add(seq_id, row)
    with pytest.raises(InvalidArgumentError, match="names a sequence twice"):
        index.rows(np.array([ids[0], ids[1], ids[0]], dtype=np.uint64))
    assert index.rows(np.array(ids[::-1], dtype=np.uint64)).tolist() == [1, 0]
