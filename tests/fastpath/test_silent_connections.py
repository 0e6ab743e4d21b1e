"""Issue 30.4: connections to the fast-path socket that never send their token do not hold up the serving thread
(it waited up to 50 ms on each, so a stream of them stalled every channel): they wait in a bounded table while the
thread serves the others, and are closed once late (HANDSHAKE_TIMEOUT_S) or when the table is full (the oldest
first). Real server process, real sockets on its abstract unix address."""

from __future__ import annotations

import time

from benchmarks.hostile_fastpath import closed_by_server, silent_connections
from kvpool_client import KVPoolClient

SERVER = ("--num-blocks", "512", "--head-dim", "8")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def socket_address(client: KVPoolClient) -> str:
    from kvpool.v1 import kvpool_pb2 as pb

    return client._stub.OpenFastPath(pb.OpenFastPathRequest(session_id=client.session_id), timeout=10,
                                     metadata=client._metadata).socket_address


def test_silent_connections_do_not_hold_up_the_channels_and_are_closed_when_late(server_factory):
    server = server_factory(*SERVER)
    with KVPoolClient(server.address) as scout, KVPoolClient(server.address) as client:
        scout.register()
        silent = silent_connections(socket_address(scout), 8)  # before the client connects: ahead of it
        seqs = [client.register() for _ in range(4)]
        for _ in range(50):
            client.append(seqs, 1)
        assert client.fast_path_open
        # The thread took them (they were queued ahead of the client's own connection) and never waited on them:
        # none has been closed yet (the old code closed each after its 50 ms wait on the serving thread).
        assert not any(closed_by_server(s) for s in silent), "a silent connection was waited on and dropped"
        wait_for(lambda: all(closed_by_server(s) for s in silent), 30, "the silent connections' deadline")
        client.append(seqs, 1)
        for sock in silent:
            sock.close()


def test_more_silent_connections_than_the_table_holds_close_the_oldest(server_factory):
    from kvpool_server.fastpath.handshake import MAX_HANDSHAKES

    server = server_factory(*SERVER)
    with KVPoolClient(server.address) as scout:
        scout.register()
        address = socket_address(scout)
        first = silent_connections(address, 8)  # accepted first (the listener's queue is in order): the oldest
        rest = silent_connections(address, MAX_HANDSHAKES)
        wait_for(lambda: all(closed_by_server(s) for s in first), 10, "the oldest silent connections")
        assert not any(closed_by_server(s) for s in rest)
        with KVPoolClient(server.address) as client:  # a real client still gets its channel
            client.append(client.register(), 1)
            assert client.fast_path_open
        for sock in first + rest:
            sock.close()
