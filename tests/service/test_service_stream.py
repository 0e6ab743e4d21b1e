"""AppendTokenStream: each message is one AppendToken (same results, same errors, copy-on-write done before its
response); an error ends the stream with that message's status, the messages before it applied and it not; a
shutdown lets the message in progress finish and then ends the stream with UNAVAILABLE."""

from __future__ import annotations

import queue
import threading
import time
from concurrent import futures

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.config import ServerConfig
from kvpool_server.grpc_api.server import build_server
from kvpool_server.main import shutdown
from tests.conftest import ServerProcess
from tests.service.service_helpers import BLOCK_SIZE, connect, token_kv

_END = object()


class Stream:
    """One open AppendTokenStream over raw stubs: ``send(seq_ids, num_tokens)`` sends one message, returns its
    response; ``close()`` half-closes and returns once the server has ended the stream."""

    def __init__(self, stub) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.responses = stub.AppendTokenStream(iter(self.requests.get, _END), timeout=30)

    def send(self, seq_ids, num_tokens=()) -> pb.AppendTokenStreamResponse:
        self.requests.put(pb.AppendTokenStreamRequest(seq_ids=seq_ids, num_tokens=num_tokens))
        return next(self.responses)

    def close(self) -> None:
        self.requests.put(_END)
        assert list(self.responses) == []
        assert self.responses.code() == grpc.StatusCode.OK


def fields(response) -> tuple:
    return (list(response.slot_mapping), list(response.new_block_ids),
            [(c.src_block_id, c.dst_block_id) for c in response.copies])


def test_stream_gives_what_unary_calls_give_on_a_twin_server(server_factory) -> None:
    """The same script -- prefill, decode steps, a fork and copy-on-write appends, mixed counts -- through one
    stream on one server and unary AppendToken calls on an identical one: identical responses and final state."""
    servers = server_factory(), server_factory()
    with connect(servers[0].address) as s_stub, connect(servers[1].address) as u_stub:
        for stub in (s_stub, u_stub):
            for seq_id in (1, 2, 3):
                stub.RegisterSequence(pb.RegisterSequenceRequest(seq_id=seq_id))
        stream = Stream(s_stub)

        def both(seq_ids, num_tokens=()) -> pb.AppendTokenStreamResponse:
            streamed = stream.send(seq_ids, num_tokens)
            unary = u_stub.AppendToken(pb.AppendTokenRequest(seq_ids=seq_ids, num_tokens=num_tokens))
            assert fields(streamed) == fields(unary)
            return streamed

        assert len(both([1, 2, 3], [20, 7, 16]).new_block_ids) == 4
        for _ in range(30):
            both([1, 2, 3])
        for stub in (s_stub, u_stub):  # unary Forks between messages of the open stream
            stub.Fork(pb.ForkRequest(parent_seq_id=1, child_seq_ids=[10, 11]))
        assert len(both([10, 1], [3, 2]).copies) == 2  # 50 tokens: the last block, partial, has 3 sharers
        for _ in range(30):
            both([3, 11, 1, 10, 2], [1])
        both([2], [40])
        stream.close()
        snapshots = []
        for stub in (s_stub, u_stub):
            tables = [list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).block_ids) for s in (1, 2, 3, 10, 11)]
            snapshots.append((stub.Stats(pb.StatsRequest()), tables))
            stub.CheckInvariants(pb.CheckInvariantsRequest())
        assert snapshots[0] == snapshots[1]
        assert snapshots[0][0].num_tokens == (20 + 7 + 16) + 30 * 3 + 2 * 50 + (3 + 2) + 30 * 5 + 40


def test_an_error_ends_the_stream_earlier_messages_applied_the_failing_one_not(server: ServerProcess) -> None:
    with connect(server.address) as stub:
        a, b = (stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(2))
        unknown = 424242
        messages = [
            pb.AppendTokenStreamRequest(seq_ids=[a, b]),
            pb.AppendTokenStreamRequest(seq_ids=[a], num_tokens=[2]),
            pb.AppendTokenStreamRequest(seq_ids=[b, unknown], num_tokens=[5]),  # NOT_FOUND: b must not grow
            pb.AppendTokenStreamRequest(seq_ids=[b], num_tokens=[9]),  # after the error: never read
        ]
        responses = stub.AppendTokenStream(iter(messages), timeout=30)
        assert len(next(responses).slot_mapping) == 2
        assert len(next(responses).slot_mapping) == 2
        with pytest.raises(grpc.RpcError) as info:
            next(responses)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and str(unknown) in info.value.details()
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.num_tokens, stats.num_blocks_used) == (4, 2)
        assert [stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).num_tokens for s in (a, b)] == [3, 1]
        stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_each_error_has_the_unary_status_code(server: ServerProcess) -> None:
    """One stream per bad message, after a good one: the code AppendToken gives, and only the good one applied."""
    with connect(server.address) as stub:
        a, b = (stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(2))
        bad_messages = {
            "unknown id": ({"seq_ids": [a, 77]}, grpc.StatusCode.NOT_FOUND),
            "seq_id 0": ({"seq_ids": [a, 0]}, grpc.StatusCode.INVALID_ARGUMENT),
            "no ids": ({"seq_ids": []}, grpc.StatusCode.INVALID_ARGUMENT),
            "repeated id": ({"seq_ids": [a, a]}, grpc.StatusCode.INVALID_ARGUMENT),
            "counts mismatch": ({"seq_ids": [a, b], "num_tokens": [1, 2, 3]}, grpc.StatusCode.INVALID_ARGUMENT),
            "count 0": ({"seq_ids": [a], "num_tokens": [0]}, grpc.StatusCode.INVALID_ARGUMENT),
            "pool full": ({"seq_ids": [a, b], "num_tokens": [3000, 3000]}, grpc.StatusCode.RESOURCE_EXHAUSTED),
        }
        for applied, (name, (fields_, code)) in enumerate(bad_messages.items(), start=1):
            with pytest.raises(grpc.RpcError) as unary:
                stub.AppendToken(pb.AppendTokenRequest(**fields_), timeout=10)
            assert unary.value.code() == code, name
            responses = stub.AppendTokenStream(
                iter([pb.AppendTokenStreamRequest(seq_ids=[b]), pb.AppendTokenStreamRequest(**fields_)]), timeout=10
            )
            assert len(next(responses).slot_mapping) == 1
            with pytest.raises(grpc.RpcError) as streamed:
                next(responses)
            assert streamed.value.code() == code, (name, streamed.value.details())
            if name in ("seq_id 0", "no ids"):  # the servicer's own checks name the RPC
                assert "AppendTokenStream" in streamed.value.details()
            tokens = [stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).num_tokens for s in (a, b)]
            assert tokens == [0, applied], name
        stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_copy_on_write_through_the_stream(server: ServerProcess) -> None:
    """A child's first message into the shared partial block: the copy is in the response and already done."""
    with connect(server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stream = Stream(stub)
        stream.send([a], [20])
        a_kv = token_kv(1, range(20))
        stub.WriteKV(pb.WriteKVRequest(seq_id=a, data=a_kv.tobytes()))
        b = stub.Fork(pb.ForkRequest(parent_seq_id=a, num_children=1)).child_seq_ids[0]
        x, y = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=a)).block_ids

        reply = stream.send([b], [3])
        assert [(c.src_block_id, c.dst_block_id) for c in reply.copies] == [(y, reply.new_block_ids[0])]
        z = reply.new_block_ids[0]
        assert list(reply.slot_mapping) == [z * BLOCK_SIZE + off for off in (4, 5, 6)]
        # The copy ran before the response: b's first 20 tokens read as a's, the copied 4 included.
        assert stub.ReadKV(pb.ReadKVRequest(seq_id=b, num_tokens=20)).data == a_kv.tobytes()
        reply = stream.send([a], [2])
        assert len(reply.copies) == 0 and list(reply.slot_mapping) == [y * BLOCK_SIZE + 4, y * BLOCK_SIZE + 5]
        stream.close()
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.num_copies, stats.num_blocks_shared, stats.num_blocks_used) == (1, 1, 3)
        stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_sigterm_with_an_idle_open_stream_exits_0_without_waiting_for_it(server_factory) -> None:
    """An open stream with no message in flight does not hold shutdown for the grace period."""
    server = server_factory("--shutdown-grace-s", "30")
    with connect(server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stream = Stream(stub)
        for _ in range(5):
            stream.send([a])
        start = time.monotonic()
        assert server.stop() == 0, server.log()
        assert time.monotonic() - start < 10
        with pytest.raises(grpc.RpcError) as info:
            stream.send([a])
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


def test_sigterm_during_back_to_back_stream_messages_ends_the_stream_unavailable(server_factory) -> None:
    server = server_factory("--num-blocks", "4096", "--max-seq-len", "4096")
    outcomes: list = []
    with connect(server.address) as stub:
        seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(32)]
        stream = Stream(stub)

        def loop() -> None:
            try:
                while True:
                    assert len(stream.send(seq_ids).slot_mapping) == 32
                    outcomes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                outcomes.append(exc.code())

        thread = threading.Thread(target=loop)
        thread.start()
        deadline = time.monotonic() + 20
        while len(outcomes) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stop() == 0, server.log()
        thread.join(30)
    assert not thread.is_alive()
    assert outcomes[-1] == grpc.StatusCode.UNAVAILABLE, outcomes[-5:]
    assert set(outcomes[:-1]) == {grpc.StatusCode.OK} and len(outcomes) > 50


def test_message_in_flight_at_shutdown_is_answered_then_the_stream_ends_unavailable() -> None:
    """In-process, to hold a message in flight for sure: the test makes the stream's message step slow (it runs on
    the event loop, so the loop is busy meanwhile, as with any message)."""
    config = ServerConfig(address="127.0.0.1:0", backend="host", num_blocks=64, shutdown_grace_s=20).validate()
    handle = build_server(config)
    handle.start()
    service = handle.service
    step = service.append
    entered = threading.Event()

    def slow_append(*args, **kwargs):  # type: ignore[no-untyped-def]
        entered.set()
        time.sleep(0.5)
        return step(*args, **kwargs)

    try:
        with connect(f"127.0.0.1:{handle.port}") as stub, futures.ThreadPoolExecutor(1) as pool:
            a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
            stream = Stream(stub)
            stream.send([a], [5])
            service.append = slow_append  # type: ignore[method-assign]
            pending = pool.submit(stream.send, [a], [2])
            assert entered.wait(10)
            assert handle.admission.num_in_flight == 1
            stopper = threading.Thread(target=shutdown, args=(handle, config.shutdown_grace_s, 1.0))
            stopper.start()
            assert len(pending.result(10).slot_mapping) == 2  # finished and answered
            with pytest.raises(grpc.RpcError) as info:
                next(stream.responses)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "shutting down" in info.value.details()
            stopper.join(30)
            assert not stopper.is_alive() and handle.pool.closed
            assert handle.service.guard.manager.num_tokens(a) == 7
            assert handle.streams.last_close_reason == "shutdown"
    finally:
        handle.stop()
        handle.pool.close()
