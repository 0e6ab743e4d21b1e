"""Both clients against a real kvpool-server process, one body each: every test runs once with KVPoolClient and once
with AsyncKVPoolClient (the ``connect`` / ``client`` fixtures of conftest.py). Typed results, the exception of each
status code, deadlines, retries."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import (
    AlreadyExistsError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    KVLayout,
    NotFoundError,
    PoolStats,
    ResourceExhaustedError,
    RetryPolicy,
    UnavailableError,
)
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

NUM_BLOCKS = 256  # the fixture's pool: 256 blocks of 16 tokens, 512 bytes a token
BS = 16
MISSING = 12345  # a seq_id no test registers


def test_health_describe_pool_and_layout(client, server):
    assert client.health() == "SERVING"
    client.wait_until_serving(timeout=5.0)
    desc = client.describe_pool()
    assert desc.layout == KVLayout() == client.layout  # the seed's: 1 layer, 1 head, 64 dims, 16-token blocks, f32
    assert desc.backend == "host" and desc.shm_name
    assert desc.num_blocks == NUM_BLOCKS
    assert desc.block_bytes == 8192 and desc.token_bytes == 512
    assert desc.pool_bytes >= NUM_BLOCKS * 8192
    assert desc.server_pid == server.pid


def test_register_append_block_table_stats_free(client):
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
    step = client.append([a, b])  # one token each: a decode step, one value for all sequences
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
    (named,) = client.fork(parent, child_seq_ids=[777])
    assert named == 777
    result = client.append(children[0])  # the shared, partly filled last block is copied first
    assert result.copies.shape == (1, 2)
    src, dst = result.copies[0]
    assert src == client.block_table(parent).block_ids[1] and dst in result.new_block_ids
    assert result.slot_mapping[0] == dst * BS + 4
    assert np.array_equal(client.read_kv(children[0], 0, 20), kv)  # the copy carried the parent's KV
    report = client.check_invariants()
    assert report.ok and report.num_sequences_checked == 4
    assert client.free([parent, *children, named]) == 3


def test_write_and_read_kv_ranges(client):
    seq = client.register()
    client.append(seq, 40)
    kv = kv_pattern(token_keys(seq, 0, 40), client.layout)
    assert client.write_kv(seq, 0, kv[:25]) == 25
    assert client.write_kv(seq, 25, kv[25:]) == 15
    whole = client.read_kv(seq)
    assert whole.shape == (40, 1, 2, 1, 64) and whole.dtype == np.float32
    assert np.array_equal(whole, kv)
    assert np.array_equal(client.read_kv(seq, 17, 5), kv[17:22])


# (exception, the .method it names, the call): each fails and changes nothing; run against both clients.
STATUS_CASES = [
    (NotFoundError, "AppendToken", lambda c, seq: c.append([MISSING], 1)),
    (NotFoundError, "Free", lambda c, seq: c.free(MISSING)),
    (NotFoundError, "Fork", lambda c, seq: c.fork(MISSING, 1)),
    (NotFoundError, "GetBlockTable", lambda c, seq: c.block_table(MISSING)),
    (NotFoundError, "ReadKV", lambda c, seq: c.read_kv(MISSING)),
    (AlreadyExistsError, "RegisterSequence", lambda c, seq: c.register(seq)),
    (AlreadyExistsError, "Fork", lambda c, seq: c.fork(seq, child_seq_ids=[seq])),
    (InvalidArgumentError, "AppendToken", lambda c, seq: c.append([], 1)),
    (InvalidArgumentError, "AppendToken", lambda c, seq: c.append([seq, seq], 1)),  # the server refuses
    (InvalidArgumentError, "AppendToken", lambda c, seq: c.append(seq, 0)),  # refused before sending
    (InvalidArgumentError, "AppendToken", lambda c, seq: c.append([seq], [1, 2])),  # refused before sending
    (InvalidArgumentError, "Fork", lambda c, seq: c.fork(seq, 0)),
    (InvalidArgumentError, "Free", lambda c, seq: c.free([])),
    (InvalidArgumentError, "ReadKV", lambda c, seq: c.read_kv(seq, 3, 20)),  # past the end
    (InvalidArgumentError, "WriteKV", lambda c, seq: c.write_kv(seq, 0, np.zeros((1, 1, 2, 1, 64)))),  # float64
    (InvalidArgumentError, "WriteKV", lambda c, seq: c.write_kv(seq, 0, np.zeros((1, 1, 1, 1, 64), np.float32))),
    (ResourceExhaustedError, "AppendToken", lambda c, seq: c.append(seq, NUM_BLOCKS * BS - 5)),
    (FailedPreconditionError, "WriteKV", lambda c, seq: c.write_kv(seq, 0, np.zeros((1, 1, 2, 1, 64), np.float32))),
]


def test_status_codes_raise_their_exception_and_change_nothing(client):
    seq = client.register()
    client.append(seq, 5)
    client.fork(seq, 1)  # seq's block is now shared: WriteKV into it is FAILED_PRECONDITION
    before = client.stats()
    for expected, method, call in STATUS_CASES:
        with pytest.raises(expected) as info:
            call(client, seq)
        assert info.value.code == expected.code and info.value.method == method
        assert not isinstance(info.value.__context__, grpc.RpcError) or info.value.__suppress_context__
    assert client.stats() == before


def test_double_free_is_not_found(client):
    seq = client.register()
    client.free(seq)
    with pytest.raises(NotFoundError, match=str(seq)):
        client.free(seq)


@pytest.mark.parametrize("per_call", [False, True])
def test_every_call_has_a_deadline(connect, silent_server, per_call):
    client = connect(silent_server, timeout=60 if per_call else 0.3)
    kwargs = {"timeout": 0.3} if per_call else {}
    for call in (lambda: client.stats(**kwargs), lambda: client.register(**kwargs),
                 lambda: client.append([1, 2], 1, **kwargs), lambda: client.health(**kwargs)):
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            call()
        assert 0.25 < time.monotonic() - start < 2.0
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="not SERVING"):
        client.wait_until_serving(timeout=0.5)
    assert time.monotonic() - start < 2.0


def test_unreachable_server_fails_within_the_deadline(connect, tmp_path):
    client = connect(f"unix:{tmp_path}/nobody.sock", timeout=0.5)
    start = time.monotonic()
    with pytest.raises((UnavailableError, DeadlineExceededError)):
        client.stats()  # retried, but never past the deadline
    assert time.monotonic() - start < 1.5
    with pytest.raises(UnavailableError):
        client.register()  # not retried: fails on the first UNAVAILABLE
    assert time.monotonic() - start < 1.5


class FlakyRpc:
    """A unary stub method that fails with ``code`` ``failures`` times, then returns ``reply``; counts calls. For
    the async client it answers as grpc.aio does: an awaitable that raises or returns when awaited."""

    def __init__(self, failures: int, reply: object, *, awaitable: bool,
                 code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.failures, self.reply, self.awaitable, self.code, self.calls = failures, reply, awaitable, code, 0

    def __call__(self, request, timeout=None, metadata=None):
        self.calls += 1
        assert timeout is not None and timeout > 0  # every attempt carries a deadline
        fails = self.calls <= self.failures
        if not self.awaitable:
            return self._answer(fails)

        async def answer():
            return self._answer(fails)

        return answer()

    def _answer(self, fails: bool) -> object:
        if fails:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused")
        return self.reply


def test_only_idempotent_calls_are_retried(connect, tmp_path):
    layout = pb.PoolLayout(num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=64, block_size=16,
                           dtype=pb.DTYPE_FLOAT32, block_bytes=8192, token_bytes=512)
    client = connect(f"unix:{tmp_path}/unused.sock", retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.001),
                     session=False)

    def flaky(failures, reply, code=grpc.StatusCode.UNAVAILABLE):
        return FlakyRpc(failures, reply, awaitable=connect.kind == "async", code=code)

    stub = client._stub
    stub.Stats = stats = flaky(2, pb.StatsResponse(num_blocks_total=7))
    stub.DescribePool = describe = flaky(3, pb.DescribePoolResponse(layout=layout, backend=pb.BACKEND_HOST))
    stub.GetBlockTable = table = flaky(10, None)
    stub.ReadKV = read = flaky(1, None, grpc.StatusCode.NOT_FOUND)
    client._health.Check = check = flaky(1, health_pb2.HealthCheckResponse(status=1))  # SERVING
    assert client.stats().num_blocks_total == 7 and stats.calls == 3
    assert client.layout.head_dim == 64 and describe.calls == 4
    assert client.health() == "SERVING" and check.calls == 2
    with pytest.raises(UnavailableError):
        client.block_table(1)
    assert table.calls == 4  # gave up after max_attempts
    with pytest.raises(NotFoundError):
        client.read_kv(1)
    assert read.calls == 1  # only UNAVAILABLE is retried
    calls = {"RegisterSequence": client.register, "AppendToken": lambda: client.append(1),
             "Fork": lambda: client.fork(1, 1), "Free": lambda: client.free(1),
             "WriteKV": lambda: client.write_kv(1, 0, np.zeros((1, 1, 2, 1, 64), np.float32))}
    for name, call in calls.items():
        setattr(stub, name, rpc := flaky(1, None))
        with pytest.raises(UnavailableError):
            call()
        assert rpc.calls == 1, f"{name}: a mutating call without a session's request id must never be retried"


def test_mutations_of_a_session_are_retried_with_the_same_request_id(connect, tmp_path):
    """With a session, a mutation carries a request id: the server applies it once, so it is retried -- on
    UNAVAILABLE and DEADLINE_EXCEEDED alike -- and every attempt sends the same request."""
    client = connect(f"unix:{tmp_path}/unused.sock", retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.001))
    client._session.session_id = 77  # as if OpenSession had answered (no keep-alive is needed here)
    seen: list = []

    class Recording(FlakyRpc):
        def __call__(self, request, timeout=None, metadata=None):
            seen.append(request.SerializeToString())
            return super().__call__(request, timeout, metadata)

    calls = {"RegisterSequence": (client.register, pb.RegisterSequenceResponse(seq_id=5)),
             "AppendToken": (lambda: client.append(5, 2), pb.AppendTokenResponse(slot_mapping=[0, 1])),
             "Fork": (lambda: client.fork(5, 1), pb.ForkResponse(child_seq_ids=[6])),
             "Free": (lambda: client.free(5), pb.FreeResponse(num_blocks_freed=1))}
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        for name, (call, reply) in calls.items():
            seen.clear()
            setattr(client._stub, name, rpc := Recording(2, reply, awaitable=connect.kind == "async", code=code))
            call()
            assert rpc.calls == 3 and len(set(seen)) == 1, name
            request = getattr(pb, f"{name}Request" if name != "AppendToken" else "AppendTokenRequest").FromString(seen[0])
            assert request.session_id == 77 and request.request_id > 0


def test_backoff_never_runs_past_the_deadline(connect, tmp_path):
    slow = RetryPolicy(max_attempts=4, initial_backoff_s=30.0, max_backoff_s=30.0)
    client = connect(f"unix:{tmp_path}/unused.sock", timeout=0.3, retry=slow)
    client._stub.Stats = stats = FlakyRpc(10, None, awaitable=connect.kind == "async")
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="while retrying"):
        client.stats()
    assert 0.25 < time.monotonic() - start < 1.0 and stats.calls == 1


def test_unix_socket(connect, unix_server):
    client = connect(unix_server.address)
    client.wait_until_serving()
    seq = client.register()
    client.append(seq, 33)
    report = client.check_invariants()
    assert report.ok and report.num_sequences_checked == 1 and report.num_blocks_checked >= 3
    assert client.free(seq) == 3


def test_bad_timeout_is_refused(connect):
    with pytest.raises(ValueError, match="timeout"):
        connect("127.0.0.1:1", timeout=0)
