"""ReplyCache (service/replay.py): a repeat gets the first answer; a reused id with other arguments is refused; the
window is bounded per session and per tenant, and tenants never see or evict each other's entries."""

import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError
from kvpool_server.service.replay import ENTRY_OVERHEAD, ReplyCache, answer_bytes, fingerprint


def test_repeat_gets_the_first_answer_and_other_arguments_are_refused():
    cache = ReplyCache()
    fp = fingerprint("append", [1, 2], None)
    assert cache.lookup(0, 7, 1, fp) is None
    cache.store(0, 7, 1, fp, [11, 12])
    assert cache.lookup(0, 7, 1, fp) == [11, 12]
    assert cache.lookup(0, 8, 1, fp) is None  # ids are per session
    with pytest.raises(InvalidArgumentError, match="different request"):
        cache.lookup(0, 7, 1, fingerprint("append", [1, 3], None))
    cache.check_invariants()


def test_fingerprints_tell_arguments_apart():
    assert fingerprint("free", [1, 2]) == fingerprint("free", np.array([1, 2]))
    assert len({fingerprint("free", [1, 2]), fingerprint("free", [12]), fingerprint("free", [1], [2]),
                fingerprint("fork", [1, 2]), fingerprint("free", None), fingerprint("free", b"")}) == 6


def test_window_per_session_and_in_bytes_per_tenant():
    entry = answer_bytes([0]) + ENTRY_OVERHEAD  # one int answer
    cache = ReplyCache(max_entries_per_session=3, max_bytes_per_tenant=4 * entry)
    for request_id in range(1, 6):
        cache.store(0, 1, request_id, b"f", [request_id])
    assert len(cache) == 3 and cache.num_bytes == 3 * entry
    assert cache.lookup(0, 1, 2, b"f") is None and cache.lookup(0, 1, 5, b"f") == [5]
    cache.store(0, 2, 1, b"f", [0, 0])  # over the tenant's bytes: its oldest answers (of any session) go first
    assert cache.num_bytes_of(0) <= 4 * entry and cache.lookup(0, 2, 1, b"f") == [0, 0]
    assert cache.lookup(0, 1, 3, b"f") is None and cache.lookup(0, 1, 5, b"f") == [5]
    cache.check_invariants()


def test_tenants_neither_see_nor_evict_each_others_entries():
    """Issue 20.2: a session-less request id of tenant 1 means nothing to tenant 2, and tenant 2 filling its
    budget with large answers evicts none of tenant 1's."""
    cache = ReplyCache(max_bytes_per_tenant=64 << 10)
    fp = fingerprint("register", None)
    cache.store(1, 0, 42, fp, (5, 0))
    assert cache.lookup(2, 0, 42, fp) is None  # another tenant replaying the same id and arguments: a new request
    for request_id in range(1, 200):
        cache.store(2, 0, request_id, b"g", np.zeros(4096, dtype=np.int64))  # 32 KiB each
    assert cache.lookup(1, 0, 42, fp) == (5, 0)
    assert cache.num_bytes_of(2) <= 64 << 10 and cache.num_bytes_of(1) > 0
    cache.check_invariants()


def test_an_answer_over_the_budget_is_not_kept_and_evicts_nothing():
    cache = ReplyCache(max_bytes_per_tenant=4096)
    cache.store(1, 0, 1, b"f", [1])
    cache.store(1, 0, 2, b"f", np.zeros(4096, dtype=np.int64))
    assert cache.lookup(1, 0, 1, b"f") == [1] and cache.lookup(1, 0, 2, b"f") is None


def test_dropping_a_session_frees_its_bytes_and_leaves_no_keys():
    cache = ReplyCache()
    cache.store(3, 1, 1, b"f", [1, 2, 3])
    cache.store(3, 2, 1, b"f", [4])
    cache.drop_session(3, 1)
    assert len(cache) == 1 and cache.lookup(3, 1, 1, b"f") is None
    cache.drop_session(3, 2)
    assert len(cache) == 0 and cache.num_bytes == 0
    cache.check_invariants()
