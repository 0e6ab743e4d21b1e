"""The manager's record of which session holds which sequence: register, fork, free, the sweep, and its invariant."""

import numpy as np
import pytest

from kvpool_server.core import InvariantViolationError, KVCacheManager, listings


@pytest.fixture
def manager():
    return KVCacheManager(num_blocks=64, block_size=4)


def test_register_fork_and_free_keep_ownership(manager):
    a = manager.register(session_id=7)
    b = manager.register(session_id=8)
    loose = manager.register()
    manager.append([a, b, loose], 6)
    kids = manager.fork(a, 2)  # the parent's session
    other = manager.fork(a, 1, session_id=8)  # a session forks another session's sequence: its own child
    assert manager.seq_ids_of_session(7) == sorted([a, *kids])
    assert manager.seq_ids_of_session(8) == sorted([b, *other])
    assert manager.members.session_of_seq.get(loose) is None
    manager.free(kids[0])
    assert manager.seq_ids_of_session(7) == sorted([a, kids[1]])
    manager.check_invariants()


def test_sweeping_a_session_keeps_blocks_shared_with_another(manager):
    parent = manager.register(session_id=1)
    manager.append(parent, 6)  # blocks: one full, one partial
    child = manager.fork(parent, 1, session_id=2)[0]
    before = manager.block_table(parent).copy()
    freed = manager.free(manager.seq_ids_of_session(2))
    assert freed == 0  # every block is still the parent's
    assert np.array_equal(manager.block_table(parent), before)
    assert manager.allocator.ref_count[before].tolist() == [1, 1]
    assert manager.seq_ids_of_session(2) == [] and child not in manager.index
    manager.check_invariants()


def test_usage_and_infos(manager):
    a = manager.register(session_id=5)
    manager.append(a, 5)
    manager.fork(a, 1)
    assert listings.session_usage(manager) == {5: (2, 2)}  # two sequences, two distinct blocks
    infos = listings.sequence_infos(manager, 5)
    assert [(i[1], i[2], i[3]) for i in infos] == [(5, 5, 2), (5, 5, 2)]
    assert len(listings.sequence_infos(manager)) == 2


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda m, s: m.members.session_of_seq.__setitem__(s, 99), "disagree"),
        (lambda m, s: m.members.seqs_of_session.__setitem__(42, set()), "disagree"),
        (lambda m, s: (m.members.session_of_seq.__setitem__(12345, 3), m.members.seqs_of_session[3].add(12345)),
         "not live"),
    ],
)
def test_the_ownership_invariant_fires(manager, corrupt, message):
    seq_id = manager.register(session_id=3)
    manager.check_invariants()
    corrupt(manager, seq_id)
    with pytest.raises(InvariantViolationError, match=message):
        manager.check_invariants()
