"""Nothing half-applied: an append whose reply might not be deliverable -- over the server's --max-message-bytes,
over the client's declared (or the assumed 4 MiB) receive limit, or over --max-tokens-per-call -- is refused before
the core changes anything, unary and stream alike (issue #10, part 1)."""

from __future__ import annotations

import queue

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import KVPoolClient
from tests.service.service_helpers import connect

# The issue's server: 2**20 blocks of 16 tokens of 4 bytes (64 MiB of /dev/shm); slots are 3-byte varints.
BIG_POOL = ("--num-blocks", "1048576", "--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "1",
            "--dtype", "float16")
RECEIVE_KEY = "kvpool-max-receive-bytes"


def stream_call(stub, request: pb.AppendTokenStreamRequest, metadata=()) -> grpc.RpcError:  # type: ignore[no-untyped-def]
    requests: queue.SimpleQueue = queue.SimpleQueue()
    responses = stub.AppendTokenStream(iter(requests.get, None), metadata=metadata, timeout=20)
    requests.put(request)
    with pytest.raises(grpc.RpcError) as info:
        next(responses)
    requests.put(None)
    return info.value


def refused_unchanged(stub, call, metadata=(), expect: str = "") -> str:  # type: ignore[no-untyped-def]
    """Run ``call(metadata)`` (unary or stream), expect INVALID_ARGUMENT, and Stats unchanged; returns details."""
    before = stub.Stats(pb.StatsRequest())
    error = call(metadata)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
    assert expect in error.details(), error.details()
    assert stub.Stats(pb.StatsRequest()) == before
    stub.CheckInvariants(pb.CheckInvariantsRequest())
    return error.details()


def unary(stub, request):  # type: ignore[no-untyped-def]
    def call(metadata):  # type: ignore[no-untyped-def]
        with pytest.raises(grpc.RpcError) as info:
            stub.AppendToken(request, metadata=metadata, timeout=20)
        return info.value
    return call


def stream(stub, request):  # type: ignore[no-untyped-def]
    stream_request = pb.AppendTokenStreamRequest(seq_ids=request.seq_ids, num_tokens=request.num_tokens)
    return lambda metadata: stream_call(stub, stream_request, metadata)


@pytest.mark.parametrize("kind", [unary, stream])
def test_the_issues_cases_are_refused_and_change_nothing(server_factory, kind) -> None:  # type: ignore[no-untyped-def]
    default = server_factory(*BIG_POOL)
    small = server_factory(*BIG_POOL, "--max-message-bytes", "65536")
    with connect(default.address) as stub:
        seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(512)]
        # 512 sequences x 32,768 tokens took the whole pool and failed at the send
        refused_unchanged(stub, kind(stub, pb.AppendTokenRequest(seq_ids=seq_ids, num_tokens=[32768])),
                          expect="--max-tokens-per-call")
        # one sequence x 32,768 tokens: a 96 KiB reply, over a client that declares 64 KiB
        details = refused_unchanged(stub, kind(stub, pb.AppendTokenRequest(seq_ids=seq_ids[:1], num_tokens=[32768])),
                                    metadata=((RECEIVE_KEY, "65536"),), expect=f"{RECEIVE_KEY}=65536")
        assert "nothing was appended" in details
    with connect(small.address) as stub:
        seq_id = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        # --max-message-bytes 65536: one sequence x 32,768 tokens took 2,048 blocks and failed at the send
        refused_unchanged(stub, kind(stub, pb.AppendTokenRequest(seq_ids=[seq_id], num_tokens=[32768])),
                          expect="--max-message-bytes=65536")
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq_id], num_tokens=[14000]))  # 56 KB: fits
        assert len(reply.slot_mapping) == 14000


@pytest.mark.parametrize("kind", [unary, stream])
def test_a_client_that_declares_nothing_is_assumed_to_take_4_mib(server_factory, kind) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(*BIG_POOL, "--max-tokens-per-call", "4000000", "--max-seq-len", "4194304")
    with connect(server.address) as stub:
        seq_ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(2)]
        request = pb.AppendTokenRequest(seq_ids=seq_ids, num_tokens=[800_000])  # 1.6 M slots: ~4.8 MB of reply
        refused_unchanged(stub, kind(stub, request), expect="4 MiB assumed")
        # The same with the limit declared (and the channel able to take it): applied.
        with grpc.insecure_channel(server.address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
            big = pb_stub(ch).AppendToken(request, metadata=((RECEIVE_KEY, str(64 << 20)),), timeout=30)
            assert len(big.slot_mapping) == 1_600_000


def pb_stub(channel):  # type: ignore[no-untyped-def]
    from kvpool.v1 import kvpool_pb2_grpc

    return kvpool_pb2_grpc.KVPoolServiceStub(channel)


def test_the_client_library_declares_its_receive_limit(server_factory) -> None:
    server = server_factory(*BIG_POOL)
    with KVPoolClient(server.address, options=[("grpc.max_receive_message_length", 65536)]) as kv:
        seq = kv.register()
        with pytest.raises(Exception, match="kvpool-max-receive-bytes=65536"):
            kv.append([seq], 32768)
        assert kv.stats().num_blocks_used == 0
        with kv.append_stream() as steps, pytest.raises(Exception, match="kvpool-max-receive-bytes=65536"):
            steps.step([seq], 32768)
        assert kv.append([seq], 14000).slot_mapping.size == 14000
