"""A session's end is logged with its id in hex (as kvctl shows it) and the reason as the metric's label (24.7)."""

from __future__ import annotations

import time

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import KVPoolClient

WAIT_S = 30.0


def _wait_for(server, text: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while text not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    return server.log()


def test_closed_and_expired_sessions_are_logged_in_hex_with_the_metric_labels(server):
    with KVPoolClient(server.address, client_name="closer") as client:
        client.register()
        closed = client._session.session_id
    _wait_for(server, f"session {closed:#x} (closer) ended, closed: 1 sequences")
    with grpc.insecure_channel(server.address) as channel:
        opened = pb_grpc.KVPoolServiceStub(channel).OpenSession(
            pb.OpenSessionRequest(client_name="quiet", lease_ttl_ms=200), timeout=10)
    log = _wait_for(server, f"session {opened.session_id:#x} (quiet) ended, lease_expired")
    assert "lease expired" not in log and f"session {opened.session_id} " not in log
