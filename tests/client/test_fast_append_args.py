"""The fast path's append arguments: the last batch's uint64 ids are reused only while the ids are the same."""

from __future__ import annotations

import numpy as np

from kvpool_client.fast_args import append_args, uint32_tokens


def test_a_batch_changed_in_place_is_converted_again() -> None:
    ids = [5, 6, 7]
    first = append_args(ids, 1)
    assert first is not None and first[1].tolist() == [5, 6, 7] and first[0] == (5, 6, 7)
    ids[1] = 9  # the same list object, another batch
    second = append_args(ids, 1)
    assert second is not None and second[1].tolist() == [5, 9, 7] and second[0] == (5, 9, 7)
    again = append_args([5, 9, 7], 1)  # an equal batch: the same values either way
    assert again is not None and again[1].tolist() == [5, 9, 7] and again[2].tolist() == [1, 1, 1]


def test_bad_ids_still_go_to_grpc_for_their_error() -> None:
    assert append_args([], 1) is None
    assert append_args([-1, 2], 1) is None
    assert append_args([[1, 2]], 1) is None
    assert append_args([1, 2], 0) is None


def test_token_ids_of_unsigned_types_skip_the_range_pass_and_others_are_checked() -> None:
    assert uint32_tokens(np.array([1, 2**32 - 1], dtype=np.uint32)).tolist() == [1, 2**32 - 1]
    assert uint32_tokens(np.array([3], dtype=np.uint8)).dtype == np.uint32
    assert uint32_tokens(np.array([2**32], dtype=np.uint64)) is None
    assert uint32_tokens(np.array([-1], dtype=np.int64)) is None
    assert uint32_tokens([1, 2]).tolist() == [1, 2]
    assert uint32_tokens([0, 2**32 - 1]).dtype == np.uint32 and uint32_tokens([]).tolist() == []
    for bad in ([-1], [2**32], [2**70], [1.5], ["1"], [[1, 2]], [None]):  # a list: through array.array
        assert uint32_tokens(bad) is None, bad
    assert uint32_tokens(np.zeros((1, 2), dtype=np.uint32)) is None
