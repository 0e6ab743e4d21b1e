"""The servicer's parts in-process, without a server: Drain, the id checks of parse, the append handler over a
manager and a pool (no servicer), the Pool protocol, and build_server binding without starting."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvpool.layout import KVLayout
from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core.sessions import SessionTable
from kvpool_server.replies import ReplyCache
from kvpool_server.session_gate import SessionGate
from kvpool_server import parse
from kvpool_server.append_rpc import append
from kvpool_server.config import ServerConfig
from kvpool_server.core import InvalidArgumentError, KVCacheManager, SequenceNotFoundError
from kvpool_server.device import create_pool
from kvpool_server.drain import Drain
from kvpool_server.errors import ServerShuttingDownError
from kvpool_server.grpc_server import build_server
from kvpool_server.pool_protocol import Pool


def test_drain_counts_admitted_calls_and_refuses_once_started() -> None:
    drain = Drain()
    drain.admit()
    drain.admit()
    assert drain.num_in_flight == 2 and not drain.draining
    drain.release()
    drain.start()
    assert drain.draining
    with pytest.raises(ServerShuttingDownError, match="shutting down"):
        drain.admit()
    assert drain.num_in_flight == 2  # the refused call is counted until its caller releases it
    drain.release()
    drain.release()
    assert drain.num_in_flight == 0


def test_drain_waits_for_quiet_then_for_the_calls_in_flight() -> None:
    drain = Drain()
    drain.admit()
    drain.start()
    started = time.monotonic()
    drain.wait_quiet(quiet_s=0.05, max_s=5.0)  # nobody is refused: quiet 0.05 s after start()
    assert time.monotonic() - started < 1.0 and drain.quiet_since <= started
    assert drain.wait_idle(0.05) == 1  # the call admitted before start() is still running
    threading.Timer(0.1, drain.release).start()
    assert drain.wait_idle(5.0) == 0


def test_drain_wait_quiet_stops_at_max_s_while_calls_keep_being_refused() -> None:
    drain = Drain()
    drain.start()
    stop = threading.Event()

    def refused_calls() -> None:
        while not stop.is_set():
            with contextlib.suppress(ServerShuttingDownError):
                drain.admit()
            drain.release()
            time.sleep(0.01)

    caller = threading.Thread(target=refused_calls)
    caller.start()
    try:
        started = time.monotonic()
        drain.wait_quiet(quiet_s=0.2, max_s=0.3)
        assert 0.3 <= time.monotonic() - started < 1.0
    finally:
        stop.set()
        caller.join()


@pytest.mark.parametrize(
    "check",
    [
        lambda: parse.seq_id(0, "GetBlockTable"),
        lambda: parse.new_seq_id(0, is_set=True),
        lambda: parse.batch_seq_ids([5, 0], "Free", max_batch=8),
        lambda: parse.fork_children(0, [7, 0], max_batch=8),
    ],
    ids=["single", "register", "batch", "fork-children"],
)
def test_id_zero_is_invalid_argument_wherever_it_appears(check) -> None:
    with pytest.raises(InvalidArgumentError, match="0 is not a sequence"):
        check()


def test_parse_passes_good_ids_through() -> None:
    assert parse.new_seq_id(0, is_set=False) is None
    assert parse.seq_id(9, "ReadKV") == 9
    assert parse.batch_seq_ids([3, 4], "Free", max_batch=2).tolist() == [3, 4]
    with pytest.raises(InvalidArgumentError, match="max_batch=2"):
        parse.batch_seq_ids([3, 4, 5], "Free", max_batch=2)
    assert parse.append_counts([], 3) == 1 and parse.append_counts([4], 3) == 4
    assert parse.append_counts([1, 2, 3], 3).tolist() == [1, 2, 3]


def test_the_append_handler_needs_a_manager_a_pool_a_lock_and_a_gate_not_a_servicer() -> None:
    layout = KVLayout()
    with create_pool(layout, backend="host", num_blocks=8) as pool:
        manager = KVCacheManager(pool.num_blocks, layout.block_size)
        a = manager.register()
        lock = threading.Lock()
        gate = SessionGate(SessionTable(1), ReplyCache())
        reply = append(manager, pool, lock, gate, pb.AppendTokenRequest(seq_ids=[a], num_tokens=[17]),
                       pb.AppendTokenResponse, max_batch=4, rpc="AppendToken")
        assert len(reply.slot_mapping) == 17 and len(reply.new_block_ids) == 2 and not lock.locked()
        b = manager.fork(a, 1)[0]
        reply = append(manager, pool, lock, gate, pb.AppendTokenStreamRequest(seq_ids=[b]), pb.AppendTokenStreamResponse,
                       max_batch=4, rpc="AppendTokenStream")
        assert [(c.src_block_id, c.dst_block_id) for c in reply.copies] == [(manager.block_table(a)[1],
                                                                            reply.new_block_ids[0])]
        with pytest.raises(InvalidArgumentError, match="AppendTokenStream seq_ids: 0"):
            append(manager, pool, lock, gate, pb.AppendTokenStreamRequest(seq_ids=[a, 0]), pb.AppendTokenStreamResponse,
                   max_batch=4, rpc="AppendTokenStream")
        with pytest.raises(SequenceNotFoundError):
            append(manager, pool, lock, gate, pb.AppendTokenRequest(seq_ids=[a, 12345]), pb.AppendTokenResponse,
                   max_batch=4, rpc="AppendToken")
        assert manager.num_tokens(a) == 17 and manager.num_tokens(b) == 18
        manager.check_invariants()


def test_build_server_binds_but_does_not_start_until_start() -> None:
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=16).validate()
    handle = build_server(config)
    try:
        assert handle.port and not handle.pool.closed and handle.drain is handle.servicer.drain
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError):  # bound (the port is ours) but nobody answers yet
                health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
            handle.start()
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
    finally:
        handle.stop()
        handle.pool.close()


def test_the_host_pool_is_a_pool() -> None:
    """``Pool`` is runtime-checkable: this checks the member names (the GPU pool shares KVPool's, see device/)."""
    with create_pool(KVLayout(), backend="host", num_blocks=4) as pool:
        assert isinstance(pool, Pool)
    assert not isinstance(object(), Pool)
