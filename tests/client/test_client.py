"""KVPoolClient against a real kvpool-server process: typed results, exception mapping, deadlines, retries."""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest

from kvpool_client import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVLayout,
    KVPoolClient,
    NotFoundError,
    PoolStats,
    ResourceExhaustedError,
    RetryPolicy,
    UnavailableError,
)
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

NUM_BLOCKS = 256  # the fixture's pool: 256 blocks of 16 tokens, 512 bytes a token
BS = 16


@pytest.fixture
def client(server):
    with KVPoolClient(server.address, timeout=5.0) as c:
        yield c


def test_health_and_describe_pool(client):
    assert client.health() == "SERVING"
    desc = client.describe_pool()
    assert desc.layout == KVLayout()  # the seed's layout: 1 layer, 1 head, 64 dims, 16-token blocks, float32
    assert desc.backend == "host" and desc.shm_name
    assert desc.num_blocks == NUM_BLOCKS
    assert desc.block_bytes == 8192 and desc.token_bytes == 512
    assert desc.pool_bytes >= NUM_BLOCKS * 8192
    assert desc.server_pid > 0


def test_register_append_block_table_free(client):
    a = client.register()
    b = client.register(seq_id=10**12)
    assert b == 10**12 and a != b
    result = client.append([a, b], [20, 3])
    assert result.slot_mapping.dtype == np.int64 and result.slot_mapping.shape == (23,)
    assert len(result.new_block_ids) == 3 and result.copies.shape == (0, 2)
    split = result.split()
    assert [len(split[a]), len(split[b])] == [20, 3]
    assert np.array_equal(result.slots_of(b), result.slot_mapping[20:])
    table = client.block_table(a)
    assert table.num_tokens == 20 and table.block_size == BS and len(table.block_ids) == 2
    assert np.array_equal(table.slots(), split[a])
    # One token each: a decode step, one value for all sequences.
    step = client.append([a, b])
    assert step.slot_mapping.shape == (2,)
    assert step.slot_mapping[0] == table.block_ids[1] * BS + 4
    stats = client.stats()
    assert isinstance(stats, PoolStats)
    assert (stats.num_blocks_used, stats.num_sequences, stats.num_tokens) == (3, 2, 25)
    assert stats.num_blocks_free == NUM_BLOCKS - 3 and stats.utilization == pytest.approx(3 / NUM_BLOCKS)
    assert stats.num_slots_unused == 3 * BS - 25 and stats.block_size == BS
    assert client.free([a, b]) == 3
    assert client.stats().num_blocks_used == 0


def test_fork_shares_blocks_and_append_copies_on_write(client):
    parent = client.register()
    client.append(parent, 20)
    kv = kv_pattern(token_keys(parent, 0, 20), client.layout)
    assert client.write_kv(parent, 0, kv) == 20
    children = client.fork(parent, 2)
    assert len(children) == 2
    for child in children:
        assert np.array_equal(client.block_table(child).block_ids, client.block_table(parent).block_ids)
    assert client.stats().num_blocks_shared == 2
    result = client.append(children[0])  # the shared, partly filled last block is copied first
    assert result.copies.shape == (1, 2)
    src, dst = result.copies[0]
    assert src == client.block_table(parent).block_ids[1] and dst in result.new_block_ids
    assert result.slot_mapping[0] == dst * BS + 4
    assert np.array_equal(client.read_kv(children[0], 0, 20), kv)  # the copy carried the parent's KV
    assert client.free([parent, *children]) == 3


def test_write_and_read_kv_ranges(client):
    seq = client.register()
    client.append(seq, 40)
    kv = kv_pattern(token_keys(seq, 0, 40), client.layout)
    client.write_kv(seq, 0, kv[:25])
    client.write_kv(seq, 25, kv[25:])
    whole = client.read_kv(seq)
    assert whole.shape == (40, 1, 2, 1, 64) and whole.dtype == np.float32
    assert np.array_equal(whole, kv)
    assert np.array_equal(client.read_kv(seq, 17, 5), kv[17:22])
    with pytest.raises(InvalidArgumentError):
        client.write_kv(seq, 0, kv[:, :, :1])  # wrong token shape: refused before sending
    with pytest.raises(InvalidArgumentError):
        client.write_kv(seq, 0, kv.astype(np.float64))
    with pytest.raises(InvalidArgumentError):
        client.read_kv(seq, 30, 20)  # past the end: the server refuses


def test_status_codes_raise_their_exception_and_change_nothing(client):
    seq = client.register()
    client.append(seq, 5)
    client.fork(seq, 1)
    before = client.stats()
    cases = [
        (NotFoundError, lambda: client.append([12345], 1)),
        (NotFoundError, lambda: client.free(12345)),
        (NotFoundError, lambda: client.fork(12345, 1)),
        (NotFoundError, lambda: client.block_table(12345)),
        (NotFoundError, lambda: client.read_kv(12345)),
        (AlreadyExistsError, lambda: client.register(seq)),
        (InvalidArgumentError, lambda: client.append([], 1)),
        (InvalidArgumentError, lambda: client.append([seq, seq], 1)),
        (InvalidArgumentError, lambda: client.append(seq, 0)),
        (InvalidArgumentError, lambda: client.fork(seq, 0)),
        (InvalidArgumentError, lambda: client.free([])),
        (ResourceExhaustedError, lambda: client.append(seq, NUM_BLOCKS * BS - 5)),
        (FailedPreconditionError, lambda: client.write_kv(seq, 0, np.zeros((1, 1, 2, 1, 64), np.float32))),
    ]
    for expected, call in cases:
        with pytest.raises(expected) as info:
            call()
        assert info.value.code == expected.code
    assert client.stats() == before


def test_double_free_is_not_found(client):
    seq = client.register()
    client.free(seq)
    with pytest.raises(NotFoundError, match=str(seq)):
        client.free(seq)


@pytest.fixture
def silent_server():
    """A TCP port that completes the TCP handshake but never speaks HTTP/2: every call hangs until its deadline."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize("per_call", [False, True])
def test_every_call_has_a_deadline(silent_server, per_call):
    with KVPoolClient(silent_server, timeout=60 if per_call else 0.3) as client:
        kwargs = {"timeout": 0.3} if per_call else {}
        for call in (lambda: client.stats(**kwargs), lambda: client.register(**kwargs),
                     lambda: client.append([1, 2], 1, **kwargs)):
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                call()
            assert 0.25 < time.monotonic() - start < 2.0


def test_unreachable_server_fails_within_the_deadline(tmp_path):
    with KVPoolClient(f"unix:{tmp_path}/nobody.sock", timeout=0.5) as client:
        start = time.monotonic()
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            client.stats()  # retried, but never past the deadline
        assert time.monotonic() - start < 1.5


class _FlakyRpc:
    """Raises UNAVAILABLE ``failures`` times, then returns ``reply``; counts calls."""

    def __init__(self, failures: int, reply: object) -> None:
        self.failures, self.reply, self.calls = failures, reply, 0

    def __call__(self, request, timeout=None):
        self.calls += 1
        assert timeout is not None and timeout > 0  # every attempt carries a deadline
        if self.calls <= self.failures:
            raise _Unavailable()
        return self.reply


class _Unavailable(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection refused"


def test_only_idempotent_calls_are_retried(tmp_path):
    from kvpool.v1 import kvpool_pb2 as pb

    client = KVPoolClient(f"unix:{tmp_path}/unused.sock", retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.001))
    client._stub.Stats = stats = _FlakyRpc(2, pb.StatsResponse(num_blocks_total=7))
    client._stub.GetBlockTable = table = _FlakyRpc(10, None)
    client._stub.RegisterSequence = register = _FlakyRpc(1, pb.RegisterSequenceResponse(seq_id=3))
    client._stub.AppendToken = append = _FlakyRpc(1, None)
    client._stub.Free = free = _FlakyRpc(1, None)
    client._stub.Fork = fork = _FlakyRpc(1, None)
    assert client.stats().num_blocks_total == 7 and stats.calls == 3
    with pytest.raises(UnavailableError):
        client.block_table(1)
    assert table.calls == 4  # gave up after max_attempts
    for call, rpc in ((client.register, register), (lambda: client.append(1), append),
                      (lambda: client.free(1), free), (lambda: client.fork(1, 1), fork)):
        with pytest.raises(UnavailableError):
            call()
        assert rpc.calls == 1, "a mutating call must never be retried"
    client.close()


def test_unix_socket_and_check_invariants(unix_server):
    with KVPoolClient(unix_server.address) as client:
        seq = client.register()
        client.append(seq, 33)
        report = client.check_invariants()
        assert report.ok and report.num_sequences_checked == 1 and report.num_blocks_checked >= 3
        client.free(seq)
