"""AsyncKVPoolClient against a real kvpool-server process: the sync client's results, exceptions, deadlines and
retry policy, on grpc.aio. Plain pytest functions that drive coroutines with asyncio.run (no pytest-asyncio)."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import (
    AlreadyExistsError,
    AsyncKVPoolClient,
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
from kvpool_client.errors import ERROR_FOR_CODE, UnknownError, from_rpc_error
from kvpool_client.loadgen.pattern import kv_pattern, token_keys

NUM_BLOCKS = 256  # the fixture's pool: 256 blocks of 16 tokens, 512 bytes a token
BS = 16


def run_with_client(address: str, body, **kwargs):
    """asyncio.run(body(client)) with an AsyncKVPoolClient made (and closed) inside that event loop."""

    async def main():
        async with AsyncKVPoolClient(address, **kwargs) as client:
            return await body(client)

    return asyncio.run(main())


def same(a, b) -> bool:
    return (a.seq_ids == b.seq_ids and all(np.array_equal(getattr(a, f), getattr(b, f))
                                           for f in ("num_tokens", "slot_mapping", "new_block_ids", "copies")))


def test_health_describe_pool_and_layout(server):
    async def body(client):
        assert await client.health() == "SERVING"
        await client.wait_until_serving(timeout=5.0)
        desc = await client.describe_pool()
        assert await client.layout() == KVLayout() == desc.layout
        return desc

    desc = run_with_client(server.address, body, timeout=5.0)
    assert desc.backend == "host" and desc.shm_name and desc.num_blocks == NUM_BLOCKS
    assert desc.block_bytes == 8192 and desc.token_bytes == 512 and desc.server_pid == server.pid
    with KVPoolClient(server.address) as sync:
        assert sync.describe_pool() == desc  # the same PoolDescription, field for field


def test_register_append_block_table_stats_free(server):
    async def body(client):
        a = await client.register()
        b = await client.register(seq_id=10**12)
        assert b == 10**12 and a != b
        result = await client.append([a, b], [20, 3])
        assert result.slot_mapping.dtype == np.int64 and result.slot_mapping.shape == (23,)
        assert len(result.new_block_ids) == 3 and result.copies.shape == (0, 2)
        split = result.split()
        table = await client.block_table(a)
        assert table.num_tokens == 20 and table.block_size == BS and len(table.block_ids) == 2
        assert np.array_equal(table.slots(), split[a])
        step = await client.append([a, b])
        assert step.slot_mapping.shape == (2,) and step.slot_mapping[0] == table.block_ids[1] * BS + 4
        stats = await client.stats()
        assert isinstance(stats, PoolStats)
        assert (stats.num_blocks_used, stats.num_sequences, stats.num_tokens) == (3, 2, 25)
        assert stats.num_blocks_free == NUM_BLOCKS - 3 and stats.utilization == pytest.approx(3 / NUM_BLOCKS)
        assert await client.free([a, b]) == 3
        assert (await client.stats()).num_blocks_used == 0

    run_with_client(server.address, body, timeout=5.0)


def test_concurrent_calls_on_one_channel(server):
    async def body(client):
        ids = await asyncio.gather(*(client.register() for _ in range(32)))
        assert len(set(ids)) == 32
        results = await asyncio.gather(*(client.append(seq_id, 17) for seq_id in ids))
        slots = np.concatenate([r.slot_mapping for r in results])
        assert len(np.unique(slots)) == 32 * 17  # no two sequences were given the same slot
        tables = await asyncio.gather(*(client.block_table(seq_id) for seq_id in ids))
        assert all(np.array_equal(t.slots(), r.slot_mapping) for t, r in zip(tables, results))
        assert (await client.check_invariants()).num_sequences_checked == 32
        assert sum(await asyncio.gather(*(client.free(seq_id) for seq_id in ids))) == 64
        assert (await client.stats()).num_blocks_used == 0

    run_with_client(server.address, body, timeout=5.0)


def test_fork_write_read_kv_and_check_invariants(server):
    async def body(client):
        parent = await client.register()
        await client.append(parent, 20)
        layout = await client.layout()
        kv = kv_pattern(token_keys(parent, 0, 20), layout)
        assert await client.write_kv(parent, 0, kv[:12]) == 12
        assert await client.write_kv(parent, 12, kv[12:]) == 8
        children = await client.fork(parent, 2)
        assert len(children) == 2 and (await client.stats()).num_blocks_shared == 2
        (named,) = await client.fork(parent, child_seq_ids=[777])
        assert named == 777
        result = await client.append(children[0])  # the shared, partly filled last block is copied first
        assert result.copies.shape == (1, 2) and result.copies[0, 1] in result.new_block_ids
        whole = await client.read_kv(children[0], 0, 20)  # the copy carried the parent's KV
        assert whole.dtype == np.float32 and whole.shape == (20, 1, 2, 1, 64) and np.array_equal(whole, kv)
        assert np.array_equal(await client.read_kv(parent, 7, 5), kv[7:12])
        report = await client.check_invariants()
        assert report.ok and report.num_sequences_checked == 4
        assert await client.free([parent, *children, named]) == 3

    run_with_client(server.address, body, timeout=5.0)


def test_results_equal_the_sync_clients_on_a_twin_server(server_factory):
    script = [("register", 1), ("register", 2), ("append", [1, 2], [17, 5]), ("append", [1, 2], 1),
              ("fork", 1, [9]), ("append", 9, 3), ("append", [2, 9, 1], np.array([1, 2, 3]))]
    first, second = server_factory(), server_factory()

    async def body(client):
        out = []
        for name, *args in script:
            out.append(await (client.fork(args[0], child_seq_ids=args[1]) if name == "fork"
                              else getattr(client, name)(*args)))
        return out, await client.stats(), [await client.block_table(s) for s in (1, 2, 9)]

    got, stats, tables = run_with_client(first.address, body)
    with KVPoolClient(second.address) as sync:
        want = [sync.fork(args[0], child_seq_ids=args[1]) if name == "fork" else getattr(sync, name)(*args)
                for name, *args in script]
        assert stats == sync.stats()
        assert all(np.array_equal(t.block_ids, sync.block_table(s).block_ids) for t, s in zip(tables, (1, 2, 9)))
    for a, b in zip(got, want):
        assert same(a, b) if hasattr(a, "slot_mapping") else a == b


def test_status_codes_raise_their_exception_and_change_nothing(server):
    async def body(client):
        seq = await client.register()
        await client.append(seq, 5)
        await client.fork(seq, 1)
        before = await client.stats()
        cases = [
            (NotFoundError, "AppendToken", lambda: client.append([12345], 1)),
            (NotFoundError, "Free", lambda: client.free(12345)),
            (NotFoundError, "Fork", lambda: client.fork(12345, 1)),
            (NotFoundError, "GetBlockTable", lambda: client.block_table(12345)),
            (NotFoundError, "ReadKV", lambda: client.read_kv(12345)),
            (AlreadyExistsError, "RegisterSequence", lambda: client.register(seq)),
            (InvalidArgumentError, "AppendToken", lambda: client.append([seq, seq], 1)),  # the server refuses
            (InvalidArgumentError, "AppendToken", lambda: client.append(seq, 0)),  # refused before sending
            (InvalidArgumentError, "Free", lambda: client.free([])),
            (InvalidArgumentError, "ReadKV", lambda: client.read_kv(seq, 3, 20)),
            (InvalidArgumentError, "WriteKV", lambda: client.write_kv(seq, 0, np.zeros((1, 1, 2, 1, 64)))),
            (ResourceExhaustedError, "AppendToken", lambda: client.append(seq, NUM_BLOCKS * BS - 5)),
            (FailedPreconditionError, "WriteKV",
             lambda: client.write_kv(seq, 0, np.zeros((1, 1, 2, 1, 64), np.float32))),
        ]
        for expected, method, call in cases:
            with pytest.raises(expected) as info:
                await call()
            assert info.value.code == expected.code and info.value.method == method
            assert not isinstance(info.value.__context__, grpc.RpcError) or info.value.__suppress_context__
        assert await client.stats() == before
        await client.free(seq)
        with pytest.raises(NotFoundError, match=str(seq)):
            await client.free(seq)  # a double free

    run_with_client(server.address, body, timeout=5.0)


@pytest.mark.parametrize("code", [*ERROR_FOR_CODE, grpc.StatusCode.DATA_LOSS])
def test_from_rpc_error_maps_aio_errors(code):
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="what happened")
    exc = from_rpc_error(error, "Stats")
    assert type(exc) is ERROR_FOR_CODE.get(code, UnknownError)
    assert exc.code == code and exc.details == "what happened" and exc.method == "Stats"


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
    kwargs = {"timeout": 0.3} if per_call else {}

    async def body(client):
        for call in (lambda: client.stats(**kwargs), lambda: client.register(**kwargs),
                     lambda: client.append([1, 2], 1, **kwargs), lambda: client.health(**kwargs)):
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await call()
            assert 0.25 < time.monotonic() - start < 2.0
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="not SERVING"):
            await client.wait_until_serving(timeout=0.5)
        assert time.monotonic() - start < 2.0

    run_with_client(silent_server, body, timeout=60 if per_call else 0.3)


def test_unreachable_server_fails_within_the_deadline(tmp_path):
    async def body(client):
        start = time.monotonic()
        with pytest.raises((UnavailableError, DeadlineExceededError)):
            await client.stats()  # retried, but never past the deadline
        assert time.monotonic() - start < 1.5
        with pytest.raises(UnavailableError):
            await client.register()  # not retried: fails on the first UNAVAILABLE
        assert time.monotonic() - start < 1.5

    run_with_client(f"unix:{tmp_path}/nobody.sock", body, timeout=0.5)


class _FlakyRpc:
    """An async unary stub method: raises ``code`` ``failures`` times, then returns ``reply``; counts calls."""

    def __init__(self, failures: int, reply: object, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.failures, self.reply, self.code, self.calls = failures, reply, code, 0

    async def __call__(self, request, timeout=None):
        self.calls += 1
        assert timeout is not None and timeout > 0  # every attempt carries a deadline
        if self.calls <= self.failures:
            raise grpc.aio.AioRpcError(self.code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="refused")
        return self.reply


def test_only_idempotent_calls_are_retried(tmp_path):
    layout = pb.PoolLayout(num_blocks=8, num_layers=1, num_kv_heads=1, head_dim=64, block_size=16,
                           dtype=pb.DTYPE_FLOAT32, block_bytes=8192, token_bytes=512)

    async def main():
        client = AsyncKVPoolClient(f"unix:{tmp_path}/unused.sock",
                                   retry=RetryPolicy(max_attempts=4, initial_backoff_s=0.001))
        stub = client._stub
        stub.Stats = stats = _FlakyRpc(2, pb.StatsResponse(num_blocks_total=7))
        stub.DescribePool = describe = _FlakyRpc(3, pb.DescribePoolResponse(layout=layout, backend=pb.BACKEND_HOST))
        stub.GetBlockTable = table = _FlakyRpc(10, None)
        stub.ReadKV = read = _FlakyRpc(1, None, grpc.StatusCode.NOT_FOUND)
        client._health.Check = check = _FlakyRpc(1, health_pb2.HealthCheckResponse(status=1))  # SERVING
        assert (await client.stats()).num_blocks_total == 7 and stats.calls == 3
        assert (await client.layout()).head_dim == 64 and describe.calls == 4
        assert await client.health() == "SERVING" and check.calls == 2
        with pytest.raises(UnavailableError):
            await client.block_table(1)
        assert table.calls == 4  # gave up after max_attempts
        with pytest.raises(NotFoundError):
            await client.read_kv(1)
        assert read.calls == 1  # only UNAVAILABLE is retried
        mutating = {name: _FlakyRpc(1, None) for name in ("RegisterSequence", "AppendToken", "Fork", "Free", "WriteKV")}
        for name, rpc in mutating.items():
            setattr(stub, name, rpc)
        calls = {"RegisterSequence": client.register, "AppendToken": lambda: client.append(1),
                 "Fork": lambda: client.fork(1, 1), "Free": lambda: client.free(1),
                 "WriteKV": lambda: client.write_kv(1, 0, np.zeros((1, 1, 2, 1, 64), np.float32))}
        for name, call in calls.items():
            with pytest.raises(UnavailableError):
                await call()
            assert mutating[name].calls == 1, f"{name}: a mutating call must never be retried"
        await client.close()

    asyncio.run(main())


def test_backoff_never_runs_past_the_deadline(tmp_path):
    async def main():
        slow = RetryPolicy(max_attempts=4, initial_backoff_s=30.0, max_backoff_s=30.0)
        async with AsyncKVPoolClient(f"unix:{tmp_path}/unused.sock", timeout=0.3, retry=slow) as client:
            client._stub.Stats = stats = _FlakyRpc(10, None)
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError, match="while retrying"):
                await client.stats()
            assert 0.25 < time.monotonic() - start < 1.0 and stats.calls == 1

    asyncio.run(main())


def test_unix_socket(unix_server):
    async def body(client):
        await client.wait_until_serving()
        seq = await client.register()
        await client.append(seq, 33)
        report = await client.check_invariants()
        assert report.ok and report.num_sequences_checked == 1 and report.num_blocks_checked >= 3
        assert await client.free(seq) == 3

    run_with_client(unix_server.address, body)


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError):
        AsyncKVPoolClient("127.0.0.1:1", timeout=0)
