"""Issue 30.3: fast-path channels opened but never connected expire (CONNECT_TIMEOUT_S) and end with their session
(CloseSession): their slots come back and their /dev/shm names are unlinked. The serving thread parked with no
timeout while it had no connected channel, and OpenFastPath did not wake it: one session held every slot for good.
Real server process; the names looked for in the real /dev/shm."""

from __future__ import annotations

import os
import time

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

SERVER = ("--num-blocks", "256", "--head-dim", "8", "--fast-path-max-channels", "2")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def open_unconnected(stub, session_id: int) -> str:
    """OpenFastPath, never connecting; returns the segment's name."""
    name = stub.OpenFastPath(pb.OpenFastPathRequest(session_id=session_id), timeout=10).shm_name
    assert os.path.exists(f"/dev/shm/{name}")
    return name


def refused(stub, session_id: int) -> bool:
    try:
        stub.OpenFastPath(pb.OpenFastPathRequest(session_id=session_id), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        return True
    return False


def gone(names: list[str]) -> bool:
    return not any(os.path.exists(f"/dev/shm/{name}") for name in names)


def test_close_session_releases_its_unconnected_channels_and_their_names(server_factory):
    server = server_factory(*SERVER)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        hog = stub.OpenSession(pb.OpenSessionRequest(client_name="hog", lease_ttl_ms=60_000), timeout=10).session_id
        other = stub.OpenSession(pb.OpenSessionRequest(client_name="other", lease_ttl_ms=60_000),
                                 timeout=10).session_id
        names = [open_unconnected(stub, hog) for _ in range(2)]
        assert refused(stub, other)  # every slot is the hog's
        stub.CloseSession(pb.CloseSessionRequest(session_id=hog), timeout=10)
        wait_for(lambda: gone(names), 5, "the closed session's segments")
        wait_for(lambda: not refused(stub, other), 5, "a slot for another session")


def test_a_channel_never_connected_expires_and_frees_its_slot(server_factory):
    server = server_factory(*SERVER)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(client_name="idle", lease_ttl_ms=120_000),
                                   timeout=10).session_id
        names = [open_unconnected(stub, session) for _ in range(2)]
        assert refused(stub, session)
        wait_for(lambda: gone(names), 30, "the unconnected channels' expiry (10 s)")  # the session lives on
        name = open_unconnected(stub, session)
        stub.CloseSession(pb.CloseSessionRequest(session_id=session), timeout=10)
        wait_for(lambda: gone([name]), 5, "the closed session's segment")
