"""Fixtures that run one test body against both clients: ``connect`` (parametrized "sync" / "async") opens a
KVPoolClient, or an AsyncKVPoolClient behind BlockingAsyncClient, and closes it after the test."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kvpool_client import KVPoolClient
from tests.client.blocking_aio import BlockingAsyncClient


class Connect:
    """``connect(target, **settings)``: a client of this test's ``kind`` ("sync" or "async")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.opened: list[Any] = []

    def __call__(self, target: str, **settings: Any) -> Any:
        client = KVPoolClient(target, **settings) if self.kind == "sync" else BlockingAsyncClient(target, **settings)
        self.opened.append(client)
        return client


@pytest.fixture(params=["sync", "async"])
def connect(request: pytest.FixtureRequest) -> Iterator[Connect]:
    connect = Connect(request.param)
    yield connect
    for client in connect.opened:
        client.close()


@pytest.fixture
def client(connect: Connect, server: Any) -> Any:
    """A client of each kind on the small host-pool server (256 blocks of 16 tokens, 512 bytes a token)."""
    return connect(server.address, timeout=5.0)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP port that completes the TCP handshake but never speaks HTTP/2: every call hangs until its deadline."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
