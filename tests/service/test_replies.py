"""ReplyCache: a repeat gets the first answer; a reused id with other bytes is refused; the window is bounded."""

import pytest

from kvpool_server.core import InvalidArgumentError
from kvpool_server.replies import ReplyCache, fingerprint


def test_repeat_gets_the_first_answer_and_other_bytes_are_refused():
    cache = ReplyCache()
    fp = fingerprint(b"request")
    assert cache.lookup(7, 1, fp) is None
    cache.store(7, 1, fp, b"answer")
    assert cache.lookup(7, 1, fp) == b"answer"
    assert cache.lookup(8, 1, fp) is None  # ids are per session
    with pytest.raises(InvalidArgumentError, match="different request"):
        cache.lookup(7, 1, fingerprint(b"another request"))


def test_window_per_session_and_in_bytes():
    cache = ReplyCache(max_entries_per_session=3, max_bytes=100)
    for request_id in range(1, 6):
        cache.store(1, request_id, b"f", b"x" * 10)
    assert len(cache) == 3 and cache.num_bytes == 30
    assert cache.lookup(1, 2, b"f") is None and cache.lookup(1, 5, b"f") == b"x" * 10
    cache.store(2, 1, b"f", b"y" * 80)  # over max_bytes: the oldest answers (of any session) go first
    assert cache.num_bytes == 100 and cache.lookup(2, 1, b"f") == b"y" * 80
    assert cache.lookup(1, 3, b"f") is None and cache.lookup(1, 4, b"f") == b"x" * 10


def test_dropping_a_session_frees_its_bytes():
    cache = ReplyCache()
    cache.store(1, 1, b"f", b"abc")
    cache.store(2, 1, b"f", b"de")
    cache.drop_session(1)
    assert cache.num_bytes == 2 and len(cache) == 1 and cache.lookup(1, 1, b"f") is None
