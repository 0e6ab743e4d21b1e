"""The record codec's cheap paths (header words packed, one copy of a request, the empty parts of an append reply)
read and write what its general paths do."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec

AREA = 1 << 16


@pytest.fixture
def views():
    mapping = mmap.mmap(-1, fp.segment_bytes(AREA))
    views = fp.Views(mapping, AREA)
    yield views
    views.release()
    mapping.close()  # nothing of the views is left exported


@pytest.mark.parametrize("n_ids,counts,n_tokens,extra", [
    (256, [1], 0, b""), (3, [2, 1, 5], 8, b""), (0, [], 7, b"key"), (2, [4, 2, 3, 0], 7, b"ab"), (0, [], 0, b""),
])
def test_request_arrays_are_a_copy_of_what_was_written(views, n_ids, counts, n_tokens, extra) -> None:
    rng = np.random.default_rng(n_ids + n_tokens)
    ids = rng.integers(1, 2**63, n_ids, dtype=np.uint64)
    tokens = rng.integers(0, 2**32, n_tokens, dtype=np.uint32)
    codec.write_request(views, fp.OP_APPEND, 0, 9, ids=ids, counts=np.asarray(counts, np.uint32), tokens=tokens,
                        extra=extra)
    codec.publish_request(views, 1)
    header = codec.request_header(views)
    assert header[fp.REQ_N_IDS:fp.REQ_N_TOKENS + 1] == [n_ids, len(counts), n_tokens]
    got_ids, got_counts, got_tokens, got_extra = codec.request_arrays(views, header)
    views.req_area[fp.HEADER_BYTES:] = 0xFF  # the client changes the record after the server copied it
    assert got_ids.dtype == np.uint64 and got_ids.tolist() == ids.tolist()
    assert got_counts.dtype == np.int64 and got_counts.tolist() == counts
    assert got_tokens.dtype == np.uint32 and got_tokens.tolist() == tokens.tolist()
    assert got_extra == extra
    for array in (got_ids, got_counts, got_tokens):
        assert not np.shares_memory(array, views.req_area)


def test_a_header_word_numpy_would_convert_is_written_as_before(views) -> None:
    codec.write_request(views, fp.OP_REGISTER, 0, 9, arg1=3.0)  # type: ignore[arg-type]
    assert int(views.req[fp.REQ_ARG1]) == 3
    with pytest.raises(OverflowError):
        codec.write_request(views, fp.OP_REGISTER, 0, 9, arg1=1 << 63)


def test_an_append_reply_reads_back(views) -> None:
    slots = np.arange(5, dtype=np.int64)
    codec.write_append_reply(views, slots, np.zeros(0, np.int32), np.zeros((0, 2), np.int32))
    codec.publish_reply(views, 4)
    assert codec.reply_error(views) is None and int(views.ctl[fp.CTL_REP_SEQ]) == 4
    got_slots, new, copies = codec.read_append_reply(views)
    assert got_slots.tolist() == slots.tolist()
    assert new.dtype == copies.dtype == np.int64 and new.shape == (0,) and copies.shape == (0, 2)
    codec.write_append_reply(views, slots, np.array([7, 8, 9], np.int32), np.array([[1, 2]], np.int32))
    got_slots, new, copies = codec.read_append_reply(views)
    assert new.tolist() == [7, 8, 9] and copies.tolist() == [[1, 2]] and copies.dtype == np.int64


def test_an_error_reply_reads_back(views) -> None:
    codec.write_error_reply(views, 5, "session-not-found", "gone")
    codec.publish_reply(views, 2)
    assert codec.reply_error(views) == (5, fp.REASONS.index("session-not-found"), "gone")
