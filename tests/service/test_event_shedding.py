"""Slow SubscribeEvents consumers are shed (issue 20): subscribers that never read fill --max-event-subscribers, and
once events have filled their streams a router still subscribes -- the subscriber blocked the longest ends with
RESOURCE_EXHAUSTED saying it was too slow. Against a real server."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

BLOCK_SIZE = 256  # big blocks: each BlockStored event carries 256 token ids, so events fill a stream quickly
CAP = 3


def make_events(stub: pb_grpc.KVPoolServiceStub, rounds: int) -> None:
    """Prompts of 100 fresh blocks each, sealed and freed (then evicted by the next): ~16 KB of events a round."""
    for r in range(rounds):
        tokens = [(r * 100_003 + i) * 7919 % (2**31 - 1) for i in range(BLOCK_SIZE * 100)]
        seq = stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=tokens)).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[len(tokens)], token_ids=tokens))
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[1], token_ids=[5]))  # seals the last
        stub.Free(pb.FreeRequest(seq_ids=[seq]))


def drain(stream) -> grpc.RpcError:
    """Read ``stream`` to its end; the error it ended with."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as error:
        return error
    raise AssertionError("a SubscribeEvents stream ended OK")


def test_subscribers_that_never_read_are_shed_for_a_new_one(server_factory):
    server = server_factory("--max-event-subscribers", str(CAP), "--block-size", str(BLOCK_SIZE),
                            "--pool-bytes", str(64 << 20))
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVPoolServiceStub(channel)
        stalled = [stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=60) for _ in range(CAP)]  # never read
        router = None
        try:
            for _ in range(40):  # until the stalled streams are full and one is shed (each try makes more events)
                make_events(stub, 10)
                router = stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=60)
                try:
                    first = next(iter(router))
                    break
                except grpc.RpcError as error:
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
                    assert "--max-event-subscribers=3" in error.details()
                    time.sleep(0.25)
            else:
                raise AssertionError("no new subscriber was served while the stalled ones held every place")
            assert first.snapshot
            make_events(stub, 1)
            assert next(iter(router)).seq > first.seq  # the router follows the events
            with ThreadPoolExecutor(CAP) as pool:  # drain each stalled stream: the shed one ends with the status
                drained = [pool.submit(drain, stream) for stream in stalled]
                done, _ = wait(drained, timeout=30, return_when=FIRST_COMPLETED)
                for stream in stalled:
                    stream.cancel()
            assert done, "no stalled subscriber was ended"
            error = next(iter(done)).result()
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "too slow" in error.details() and "from_seq" in error.details()
        finally:
            for stream in stalled + ([router] if router is not None else []):
                stream.cancel()
        assert stub.Stats(pb.StatsRequest()).num_sequences == 0
