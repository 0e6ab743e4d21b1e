"""The gRPC calls a client makes, counted by name (the tests that show a call went over the fast path instead)."""

from __future__ import annotations

from typing import Any


def counting_grpc(client: Any) -> list[str]:
    """The names of the gRPC calls ``client`` (a KVPoolClient) makes from now on, in order."""
    calls: list[str] = []
    real_call = client._call

    def counted(rpc, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 -- the real call, counted
        calls.append(rpc.name)
        return (yield from real_call(rpc, *args, **kwargs))

    client._call = counted
    return calls
