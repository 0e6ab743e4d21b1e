"""Hostile bytes cost nothing, crashes leave nothing behind (issue #10, parts 4-5): malformed requests are
INVALID_ARGUMENT without a traceback or memory growth; SIGTERM completes after malformed stream messages; compressed
requests are refused; a kill -9 of the server's process group leaves no segment past the next start; reflection v1
and v1alpha both answer."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import time

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from kvpool.v1 import kvpool_pb2 as pb
from tests.service.service_helpers import SERVICE, connect

MALFORMED = b"\xff"  # a field tag with its continuation bit set and nothing after: never a valid message


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def malformed_calls(address: str, num_calls: int, concurrency: int = 64) -> dict:
    codes: dict = {}
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(SERVICE + "AppendToken", request_serializer=lambda b: b,
                                   response_deserializer=pb.AppendTokenResponse.FromString)
        remaining = iter(range(num_calls))

        async def worker() -> None:
            for _ in remaining:
                try:
                    await call(MALFORMED, timeout=10)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                codes[code] = codes.get(code, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return codes


def test_40000_malformed_requests_are_invalid_argument_and_cost_no_memory(server) -> None:
    with connect(server.address) as stub:
        with pytest.raises(grpc.RpcError) as info:
            stub.channel.unary_unary(SERVICE + "Free", request_serializer=lambda b: b)(MALFORMED, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a kvpool.v1.FreeRequest message" in info.value.details()
    asyncio.run(malformed_calls(server.address, 2000))  # warm up: allocator arenas, gRPC's caches
    before = rss_bytes(server.pid)
    started = time.monotonic()
    codes = asyncio.run(malformed_calls(server.address, 40_000))
    took = time.monotonic() - started
    growth = rss_bytes(server.pid) - before
    print(f"40,000 malformed requests in {took:.1f} s: server RSS {before / 2**20:.1f} MiB -> "
          f"{(before + growth) / 2**20:.1f} MiB ({growth / 2**20:+.2f} MiB)")
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT: 40_000}
    assert growth < 4 << 20
    assert "Traceback" not in server.log() and "Exception deserializing" not in server.log()


def test_sigterm_completes_after_50_malformed_stream_messages(server_factory) -> None:
    server = server_factory("--shutdown-grace-s", "5")
    with connect(server.address) as stub:
        call = stub.channel.stream_stream(SERVICE + "AppendTokenStream", request_serializer=lambda b: b,
                                          response_deserializer=pb.AppendTokenStreamResponse.FromString)
        seq_id = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        good = pb.AppendTokenStreamRequest(seq_ids=[seq_id]).SerializeToString()
        for _ in range(50):
            requests: queue.SimpleQueue = queue.SimpleQueue()
            responses = call(iter(requests.get, None), timeout=10)
            requests.put(good)
            next(responses)
            requests.put(MALFORMED)
            with pytest.raises(grpc.RpcError) as info:
                next(responses)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            requests.put(None)
        assert stub.Stats(pb.StatsRequest()).num_tokens == 50
    started = time.monotonic()
    assert server.stop(timeout=10) == 0, server.log()
    assert time.monotonic() - started < 5
    assert "Traceback" not in server.log()


def test_compressed_requests_are_refused(server) -> None:
    with connect(server.address) as stub:
        seq_id = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        data = bytes(64 * 512)  # 64 tokens of zeros: gzip makes them a few hundred bytes
        with pytest.raises(grpc.RpcError) as info:
            stub.WriteKV(pb.WriteKVRequest(seq_id=seq_id, data=data), compression=grpc.Compression.Gzip, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "gzip" in info.value.details()
        assert stub.Stats(pb.StatsRequest()).num_tokens == 0


def test_kill_9_of_the_process_group_leaves_no_segment_past_the_next_start(private_shm, server_factory) -> None:
    """In a /dev/shm of the test's own: another server's start-up sweep on the machine (like the one started here
    meanwhile) would take the dead server's segment first, and the test would prove nothing."""
    first = server_factory(prefix=private_shm.prefix)
    with connect(first.address) as stub:
        shm_name = stub.DescribePool(pb.DescribePoolRequest()).shm_name
    assert shm_name in private_shm.names()
    os.killpg(os.getpgid(first.pid), signal.SIGKILL)  # the server and its resource_tracker at once
    first.proc.wait()
    server_factory()  # another server of the machine, in the machine's /dev/shm: its sweep cannot reach ours
    assert shm_name in private_shm.names(), "nothing was left: the test proves nothing"
    second = server_factory(prefix=private_shm.prefix)
    assert shm_name not in private_shm.names(), "the dead server's segment outlived the next start"
    assert "left by dead servers" in second.log()


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_lists_the_service(server, version: str) -> None:
    with grpc.insecure_channel(server.address) as channel:
        info = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvpool.v1.KVPoolService")]
        replies = list(info(iter(requests), timeout=10))
    names = {s.name for s in replies[0].list_services_response.service}
    assert {"kvpool.v1.KVPoolService", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert replies[1].file_descriptor_response.file_descriptor_proto
