"""Helpers for the service tests: stubs over raw generated code, KV data patterns, whole-state snapshots."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import grpc
import numpy as np
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc

SERVICE = "/kvpool.v1.KVPoolService/"
TOKEN_FLOATS = 128  # the seed layout: 1 layer x 2 (K, V) x 1 head x 64 dims, float32
TOKEN_BYTES = TOKEN_FLOATS * 4
BLOCK_SIZE = 16


@contextlib.contextmanager
def connect(address: str) -> Iterator[pb_grpc.KVPoolServiceStub]:
    """A stub over a fresh channel; ``stub.channel`` is the channel (for raw calls)."""
    channel = grpc.insecure_channel(address)
    try:
        stub = pb_grpc.KVPoolServiceStub(channel)
        stub.channel = channel  # type: ignore[attr-defined]
        yield stub
    finally:
        channel.close()


def raw_call(channel: grpc.Channel, method: str, response_cls: type) -> grpc.UnaryUnaryMultiCallable:
    """A method that sends hand-made request bytes (to put values on the wire that the Python API refuses)."""
    return channel.unary_unary(
        SERVICE + method, request_serializer=lambda b: b, response_deserializer=response_cls.FromString
    )


def varint(value: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (a negative int32/int64 is sent as value % 2**64)."""
    value %= 1 << 64
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_varint(field_number: int, value: int) -> bytes:
    return varint(field_number << 3) + varint(value)


def token_kv(tag: int, positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """Float32 KV [n, 1, 2, 1, 64] for tokens ``positions`` of the sequence tagged ``tag``: every element an exact
    integer mixing tag, position and element index, so different tags/positions/elements differ."""
    positions = np.asarray(positions, dtype=np.int64)
    tag %= 8_388_593  # ids go up to 2**64 - 2: fold them before mixing in int64
    mixed = (tag * 1_000_003 + positions[:, None] * 7_919 + np.arange(TOKEN_FLOATS, dtype=np.int64)[None, :] * 31)
    return (mixed % (1 << 23)).astype(np.float32).reshape(len(positions), 1, 2, 1, 64)


def call_code(call: grpc.UnaryUnaryMultiCallable, request: object) -> grpc.StatusCode:
    """The status code ``call(request)`` ends with (OK if it succeeds)."""
    try:
        call(request, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def expect_error(call: grpc.UnaryUnaryMultiCallable, request: object, code: grpc.StatusCode) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    assert info.value.code() == code, f"expected {code}, got {info.value.code()}: {info.value.details()}"
    assert info.value.details(), "an error must carry a message"
    return info.value


def read_all(stub: pb_grpc.KVPoolServiceStub, seq_id: int, chunk: int = 64) -> bytes:
    """A sequence's whole KV, read in chunks (so a small message limit is no obstacle)."""
    num_tokens = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_id)).num_tokens
    parts = []
    for start in range(0, num_tokens, chunk):
        n = min(chunk, num_tokens - start)
        parts.append(stub.ReadKV(pb.ReadKVRequest(seq_id=seq_id, start_position=start, num_tokens=n)).data)
    return b"".join(parts)


def snapshot(stub: pb_grpc.KVPoolServiceStub, seq_ids: Sequence[int]) -> tuple:
    """Everything observable: the whole Stats response, then each sequence's liveness, block table and KV bytes."""
    per_seq = []
    for seq_id in seq_ids:
        try:
            table = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_id))
        except grpc.RpcError as exc:
            per_seq.append((seq_id, exc.code()))
            continue
        per_seq.append((seq_id, tuple(table.block_ids), table.num_tokens, read_all(stub, seq_id)))
    return stub.Stats(pb.StatsRequest()), per_seq
