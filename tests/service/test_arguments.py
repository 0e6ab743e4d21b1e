"""The request checks of service/arguments.py: id 0 and batch sizes, in one place."""

from __future__ import annotations

import pytest

from kvpool_server.core import InvalidArgumentError
from kvpool_server.service import arguments


@pytest.mark.parametrize(
    "check",
    [
        lambda: arguments.seq_id(0, "GetBlockTable"),
        lambda: arguments.new_seq_id(0),
        lambda: arguments.batch_seq_ids([5, 0], "Free", max_batch=8),
        lambda: arguments.fork_children(0, [7, 0], max_batch=8),
    ],
    ids=["single", "register", "batch", "fork-children"],
)
def test_id_zero_is_invalid_argument_wherever_it_appears(check) -> None:
    with pytest.raises(InvalidArgumentError, match="0 is not a sequence"):
        check()


def test_arguments_pass_good_ids_through() -> None:
    assert arguments.new_seq_id(None) is None
    assert arguments.seq_id(9, "ReadKV") == 9
    assert arguments.batch_seq_ids([3, 4], "Free", max_batch=2).tolist() == [3, 4]
    with pytest.raises(InvalidArgumentError, match="max_batch=2"):
        arguments.batch_seq_ids([3, 4, 5], "Free", max_batch=2)
    assert arguments.append_counts([], 3) == 1 and arguments.append_counts([4], 3) == 4
    assert arguments.append_counts([1, 2, 3], 3).tolist() == [1, 2, 3]
