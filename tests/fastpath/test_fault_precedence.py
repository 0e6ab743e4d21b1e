"""Which error wins when a request has two faults (docs/api.md, "Two faults in one request"), the same over the fast
path and over gRPC: the request's shape first (INVALID_ARGUMENT), then every id resolved in order (NOT_FOUND, naming
the first unknown one -- it wins over an id repeated), then repeats (INVALID_ARGUMENT), then capacity. Real server."""

from __future__ import annotations

import pytest

from kvpool_client import KVPoolClient, KVPoolClientError


def outcome(fn) -> str:
    try:
        fn()
    except KVPoolClientError as error:
        return f"{error.code.name}: {error.details}"
    return "OK"


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "grpc"])
def test_an_unknown_id_wins_over_a_repeated_one_and_the_shape_over_both(server_factory, fast):
    server = server_factory("--num-blocks", "64", "--head-dim", "8")
    with KVPoolClient(server.address, fast_path=fast) as client:
        a = client.register()
        client.append(a, 3)
        unknown = "NOT_FOUND: sequence 999 is not live (never registered, or freed)"
        assert outcome(lambda: client.free([999, 999])) == unknown
        assert outcome(lambda: client.free([a, a, 999])) == unknown
        assert outcome(lambda: client.free([a, 998, 999])).startswith("NOT_FOUND: sequence 998 ")  # the first
        assert outcome(lambda: client.append([a, a, 999], 1)) == unknown
        assert outcome(lambda: client.append([a, 999], 1 << 20)) == unknown  # before the count's checks
        assert outcome(lambda: client.free([a, a])).startswith("INVALID_ARGUMENT")
        assert outcome(lambda: client.fork(999, 0, [77, 77])) == unknown  # the parent, before the children
        assert outcome(lambda: client.fork(a, 0, [77, 77])).startswith("INVALID_ARGUMENT")
        assert outcome(lambda: client.append([a, 999], [1, 2, 3])).startswith("INVALID_ARGUMENT")  # the shape
        assert outcome(lambda: client.free([999, 0])).startswith("INVALID_ARGUMENT")  # an id 0: the shape
        assert client.fast_path_open == fast
        assert client.block_table(a).num_tokens == 3  # nothing of it applied
