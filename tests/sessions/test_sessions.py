"""Sessions against a real server and real client processes: a dead frontend gives its memory back, a zombie is
fenced, ids do not survive a restart, and a retried mutation is applied once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import KVPoolClient, NotFoundError, ServerGoneError, ServerRestartedError
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

WORKER = Path(__file__).with_name("session_worker.py")
ROOT = Path(__file__).resolve().parents[2]


class Worker:
    def __init__(self, target: str, mode: str, parent: int = 0, ttl: float | None = None) -> None:
        args = [sys.executable, str(WORKER), target, mode, str(parent or "-")] + ([str(ttl)] if ttl else [])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "READY", f"worker {mode} did not start: {line}"
        self.session_id, self.seq_ids = int(line[1]), [int(s) for s in line[2:]]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait_for(predicate, timeout: float, step: float = 0.005) -> float:
    """Seconds until ``predicate()`` held (raises after ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        time.sleep(step)
    return time.monotonic() - start


def test_a_session_closes_with_its_client_and_is_listed_while_open(server):
    with KVPoolClient(server.address, client_name="lister") as other, KVPoolClient(server.address) as client:
        seq = client.register()
        client.append(seq, 40)
        (child,) = client.fork(seq, 1)

        def listed():
            return {s.session_id: s for s in other.list_sessions()}[client.session_id]

        # the KeepAlive stream opens in the background: over the fast path the three calls can come before it
        wait_for(lambda: listed().keep_alive_open, timeout=10)
        mine = listed()
        assert (mine.num_sequences, mine.num_blocks, mine.keep_alive_open) == (2, 3, True)
        assert mine.lease_remaining_ms > 0 and mine.client_name
        assert {s.seq_id for s in other.list_sequences(client.session_id)} == {seq, child}
        assert other.session_id is None  # a client that only reads opens no session
        client.close()
        assert other.stats().num_blocks_used == 0 and other.stats().num_sequences == 0
        assert client.session_id not in {s.session_id for s in other.list_sessions()}
        assert other.check_invariants().ok


def test_sigkilled_frontends_are_reclaimed_at_once_and_the_survivor_is_intact(server):
    with KVPoolClient(server.address) as survivor:
        parent = survivor.register()
        survivor.append(parent, 37)  # two full blocks and a partial one: forks share all three
        layout = survivor.layout
        kv = kv_pattern(token_keys(parent, 0, 37), layout)
        survivor.write_kv(parent, 0, kv)
        before = survivor.stats()
        workers = [Worker(server.address, mode, parent) for mode in ("idle", "append", "fork", "fork")]
        assert survivor.stats().num_blocks_used > before.num_blocks_used
        time.sleep(0.2)  # the append worker is mid-loop
        for worker in workers:
            worker.kill()
        killed_at = time.monotonic()
        wait_for(lambda: survivor.stats().num_sequences == 1, timeout=2.0)
        reclaimed_s = time.monotonic() - killed_at
        print(f"4 SIGKILLed frontends reclaimed {reclaimed_s * 1000:.0f} ms after the kills")
        assert reclaimed_s < 1.0  # the bound is 100 ms; generous for a loaded CI machine
        after = survivor.stats()
        assert after.num_blocks_used == before.num_blocks_used == 3
        assert after.num_blocks_shared == 0
        assert [s.session_id for s in survivor.list_sessions()] == [survivor.session_id]
        assert survivor.check_invariants().ok
        assert np.array_equal(survivor.read_kv(parent), kv)


def test_a_stopped_frontend_loses_its_session_after_the_lease_and_is_fenced_when_it_wakes(server):
    zombie = Worker(server.address, "zombie", ttl=0.5)
    try:
        with KVPoolClient(server.address) as observer:
            blocks = observer.stats().num_blocks_used
            assert blocks > 0
            zombie.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            wait_for(lambda: observer.stats().num_blocks_used == 0, timeout=3.0, step=0.02)
            print(f"stopped frontend reclaimed {time.monotonic() - stopped_at:.2f} s after SIGSTOP (lease 0.5 s)")
            assert time.monotonic() - stopped_at < 0.5 + 1.0
            other = observer.register()
            observer.append(other, 30)  # another sequence takes the freed blocks
            state = observer.stats()
            zombie.proc.send_signal(signal.SIGCONT)
            zombie.proc.stdin.write("go\n")
            zombie.proc.stdin.flush()
            assert zombie.proc.stdout.readline().split() == ["REFUSED", "SessionLostError"]
            assert observer.stats() == state  # nothing applied
            assert observer.check_invariants().ok
    finally:
        zombie.proc.send_signal(signal.SIGCONT)
        zombie.kill()


def test_a_restart_ends_every_session_and_old_ids_are_not_found(server_factory, tmp_path):
    sock = str(Path("/tmp") / f"kvp-restart-{os.getpid()}.sock")
    target = f"unix:{sock}"
    first = server_factory("--unix-socket", sock)
    client = KVPoolClient(target, lease_ttl_s=5)
    seq = client.register()
    client.append(seq, 5)
    first.stop()
    second = server_factory("--unix-socket", sock)
    try:
        with KVPoolClient(target) as fresh:
            fresh.wait_until_serving()  # gRPC may share the old client's connection, backing off after the restart
            with pytest.raises(NotFoundError):
                fresh.block_table(seq)  # the old id means nothing on the new server
            new_seq = fresh.register()
            assert new_seq != seq
        with pytest.raises(ServerRestartedError):
            wait_for(lambda: client.append(seq, 1) and False, timeout=5.0)
        assert isinstance(client.server_lost, (ServerRestartedError, type(None)))
    finally:
        client.close()
        second.stop()


class _DroppedReply(grpc.RpcError, grpc.Call):
    """What a client sees when the network loses a reply: the call ran on the server, the answer never came."""

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "reply dropped on purpose"

    def trailing_metadata(self):
        return ()

    def initial_metadata(self):
        return ()

    def is_active(self):
        return False

    def time_remaining(self):
        return None

    def cancel(self):
        return False

    def add_callback(self, callback):
        return False


class DropFirstReply(grpc.UnaryUnaryClientInterceptor):
    """Lets each mutating call reach the server, then drops its first reply."""

    def __init__(self, methods: set[str]) -> None:
        self.methods = methods
        self.dropped: list[str] = []

    def intercept_unary_unary(self, continuation, details, request):
        outcome = continuation(details, request)
        name = details.method.rsplit("/", 1)[-1]
        if name in self.methods and name not in self.dropped:
            outcome.result()  # applied on the server
            self.dropped.append(name)
            raise _DroppedReply()
        return outcome


def test_a_retried_mutation_is_applied_once(server):
    interceptor = DropFirstReply({"RegisterSequence", "AppendToken", "Fork", "Free"})
    channel = grpc.intercept_channel(grpc.insecure_channel(server.address), interceptor)
    with KVPoolClient(server.address, channel=channel) as client:
        seq = client.register()
        result = client.append(seq, 20)
        (child,) = client.fork(seq, 1)
        assert interceptor.dropped == ["RegisterSequence", "AppendToken", "Fork"]
        assert client.stats().num_sequences == 2  # one register, one fork: not two each
        assert client.block_table(seq).num_tokens == 20 and len(result.slot_mapping) == 20
        assert client.free([seq, child]) == 2  # the retry answered the first answer: 2 blocks, not NOT_FOUND
        assert interceptor.dropped[-1] == "Free"
        assert client.stats().num_blocks_used == 0
        assert client.check_invariants().ok


def test_a_request_id_names_one_request(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest(client_name="raw"))
        sid = session.session_id
        seq = stub.RegisterSequence(pb.RegisterSequenceRequest(session_id=sid, request_id=1)).seq_id
        first = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[5], session_id=sid, request_id=2))
        again = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[5], session_id=sid, request_id=2))
        assert again == first
        assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).num_tokens == 5
        with pytest.raises(grpc.RpcError) as info:
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[6], session_id=sid, request_id=2))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "different request" in info.value.details()
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        with pytest.raises(grpc.RpcError) as info:
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], session_id=sid, request_id=3))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert ("kvpool-error", "session-not-found") in info.value.trailing_metadata()
        with pytest.raises(grpc.RpcError) as info:
            stub.RegisterSequence(pb.RegisterSequenceRequest(session_id=(sid ^ (1 << 40)) | 1))
        assert ("kvpool-error", "server-restarted") in info.value.trailing_metadata()
        assert stub.Stats(pb.StatsRequest()).num_sequences == 0


def test_lease_expiry_without_heartbeats(server_factory):
    server = server_factory("--session-ttl-ms", "300")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        session = stub.OpenSession(pb.OpenSessionRequest())  # no KeepAlive stream, no calls: the lease runs out
        assert session.lease_ttl_ms == 300
        seq = stub.RegisterSequence(pb.RegisterSequenceRequest(session_id=session.session_id)).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[50], session_id=session.session_id))
        opened = time.monotonic()
        took = wait_for(lambda: stub.Stats(pb.StatsRequest()).num_blocks_used == 0, timeout=2.0, step=0.02)
        assert 0.2 < time.monotonic() - opened and took < 0.3 + 1.0
        assert stub.ListSessions(pb.ListSessionsRequest()).sessions == []


def test_an_attached_pool_refuses_writes_once_the_server_is_dead(server_factory):
    server = server_factory()
    client = KVPoolClient(server.address)
    try:
        seq = client.register()
        slots = client.append(seq, 3).slot_mapping
        pool = client.attach()
        kv = kv_pattern(token_keys(seq, 0, 3), pool.layout)
        pool.write_slots(slots, kv)  # alive: fine
        server.kill()  # SIGKILL: no shutdown, no goodbye
        wait_for(lambda: client.server_lost is not None, timeout=2.0)
        assert isinstance(client.server_lost, ServerGoneError)
        with pytest.raises(ServerGoneError):
            pool.write_slots(slots, kv)
        with pytest.raises(ServerGoneError):
            client.append(seq, 1)
    finally:
        client.close()
