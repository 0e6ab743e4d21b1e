"""Every RPC's happy path against a real kvpool-server, over TCP (port 0) and over a unix socket."""

from __future__ import annotations

import mmap
import os

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import ServerProcess
from tests.service.service_helpers import BLOCK_SIZE, TOKEN_BYTES, connect, token_kv

NUM_BLOCKS = 256  # the fixture's pool


@pytest.fixture(params=["tcp", "unix"])
def any_server(request: pytest.FixtureRequest) -> ServerProcess:
    return request.getfixturevalue("server" if request.param == "tcp" else "unix_server")


def slots_of(table: list[int], positions: range) -> list[int]:
    return [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]


def test_address_kinds(server: ServerProcess, unix_server: ServerProcess) -> None:
    assert server.address.startswith("127.0.0.1:") and server.port > 0
    assert unix_server.address.startswith("unix:") and os.path.exists(unix_server.address[len("unix:"):])


def test_register_sequence(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        first = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        second = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        assert first != 0 and second != 0 and first != second
        assert stub.RegisterSequence(pb.RegisterSequenceRequest(seq_id=42)).seq_id == 42
        stub.Free(pb.FreeRequest(seq_ids=[first]))
        third = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        assert third not in (first, second, 42)  # a server id is never reused
        table = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=42))
        assert (list(table.block_ids), table.num_tokens) == ([], 0)
        assert stub.Stats(pb.StatsRequest()).num_sequences == 3


def test_append_token_slots_follow_the_block_tables(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(3)]
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=ids, num_tokens=[1, 16, 17]))
        assert len(reply.slot_mapping) == 34 and len(reply.copies) == 0
        tables = [list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).block_ids) for s in ids]
        assert [len(t) for t in tables] == [1, 1, 2]
        expected = slots_of(tables[0], range(1)) + slots_of(tables[1], range(16)) + slots_of(tables[2], range(17))
        assert list(reply.slot_mapping) == expected
        assert sorted(reply.new_block_ids) == sorted(b for t in tables for b in t)
        # One count for all, then none (1 each): slots continue where each sequence ended.
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=ids, num_tokens=[2]))
        tables = [list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)).block_ids) for s in ids]
        assert list(reply.slot_mapping) == (
            slots_of(tables[0], range(1, 3)) + slots_of(tables[1], range(16, 18)) + slots_of(tables[2], range(17, 19))
        )
        assert list(reply.new_block_ids) == [tables[1][1]]  # only the full sequence needed a block
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[ids[2], ids[0]]))
        assert list(reply.slot_mapping) == slots_of(tables[2], range(19, 20)) + slots_of(tables[0], range(3, 4))
        stats = stub.Stats(pb.StatsRequest())
        assert stats.num_tokens == 4 + 18 + 20 and stats.num_blocks_used == 5


def test_fork_shares_every_block_and_free_counts_blocks(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        parent = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[parent], num_tokens=[40]))
        children = list(stub.Fork(pb.ForkRequest(parent_seq_id=parent, num_children=2)).child_seq_ids)
        assert len(children) == 2 and parent not in children
        named = list(stub.Fork(pb.ForkRequest(parent_seq_id=parent, child_seq_ids=[1001, 1002])).child_seq_ids)
        assert named == [1001, 1002]
        same = list(stub.Fork(pb.ForkRequest(parent_seq_id=parent, num_children=1, child_seq_ids=[1003])).child_seq_ids)
        assert same == [1003]
        parent_table = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=parent))
        for child in children + named + same:
            table = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=child))
            assert (list(table.block_ids), table.num_tokens) == (list(parent_table.block_ids), 40)
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.num_blocks_used, stats.num_blocks_shared, stats.num_sequences) == (3, 3, 6)
        assert stats.num_tokens == 6 * 40
        assert stub.Free(pb.FreeRequest(seq_ids=[parent, *children, 1001, 1002])).num_blocks_freed == 0
        assert stub.Free(pb.FreeRequest(seq_ids=[1003])).num_blocks_freed == 3
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.num_blocks_free, stats.num_sequences, stats.num_tokens) == (NUM_BLOCKS, 0, 0)


def test_stats_fields(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        empty = stub.Stats(pb.StatsRequest())
        assert empty == pb.StatsResponse(
            num_blocks_total=NUM_BLOCKS, num_blocks_free=NUM_BLOCKS, block_size=BLOCK_SIZE,
            block_bytes=BLOCK_SIZE * TOKEN_BYTES,
        )
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[20]))
        b = stub.Fork(pb.ForkRequest(parent_seq_id=a, num_children=1)).child_seq_ids[0]
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[b]))  # copy-on-write of the partial block
        assert len(reply.copies) == 1
        stats = stub.Stats(pb.StatsRequest())
        assert stats == pb.StatsResponse(
            num_blocks_total=NUM_BLOCKS, num_blocks_free=NUM_BLOCKS - 3, num_blocks_used=3,
            utilization=3 / NUM_BLOCKS, num_tokens=41, num_slots_unused=(16 - 4) + (16 - 5),
            internal_fragmentation=23 / 48, num_blocks_shared=1, num_copies=1, num_sequences=2,
            block_size=BLOCK_SIZE, block_bytes=BLOCK_SIZE * TOKEN_BYTES, num_tokens_appended=20 + 1,
        )


def test_get_block_table(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[33]))
        table = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=a))
        assert (table.num_tokens, table.block_size) == (33, BLOCK_SIZE)
        assert list(table.block_ids) == list(reply.new_block_ids)
        assert list(reply.slot_mapping) == slots_of(list(table.block_ids), range(33))


def test_describe_pool_and_the_shared_memory_it_names(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        reply = stub.DescribePool(pb.DescribePoolRequest())
        assert reply.layout == pb.PoolLayout(
            num_blocks=NUM_BLOCKS, num_layers=1, num_kv_heads=1, head_dim=64, block_size=BLOCK_SIZE,
            dtype=pb.DTYPE_FLOAT32, block_bytes=BLOCK_SIZE * TOKEN_BYTES, token_bytes=TOKEN_BYTES,
            kv_layout=pb.KV_LAYOUT_BLOCK_MAJOR,
        )
        assert reply.backend == pb.BACKEND_HOST
        assert reply.pool_bytes == NUM_BLOCKS * BLOCK_SIZE * TOKEN_BYTES
        assert reply.server_pid == any_server.pid
        assert reply.shm_name and not reply.cuda_ipc_handle
        # The name maps the pool: KV written through WriteKV is at block * block_bytes + offset * token_bytes.
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        slots = list(stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[20])).slot_mapping)
        kv = token_kv(a, range(20))
        stub.WriteKV(pb.WriteKVRequest(seq_id=a, data=kv.tobytes()))
        path = "/dev/shm/" + reply.shm_name.lstrip("/")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            assert len(mapped) >= reply.pool_bytes
            # block-major [num_blocks, L=1, 2, block_size, H=1, D=64]: K and V of a token are block_size rows apart
            flat = np.frombuffer(mapped, dtype=np.float32, count=reply.pool_bytes // 4)
            pool = flat.reshape(NUM_BLOCKS, 1, 2, 16, 1, 64)
            got = np.stack([pool[s // 16, :, :, s % 16] for s in slots])
            del pool, flat
        np.testing.assert_array_equal(got, kv)


def test_write_and_read_kv(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[40]))
        kv = token_kv(7, range(40))
        assert stub.WriteKV(pb.WriteKVRequest(seq_id=a, data=kv[:25].tobytes())).num_tokens_written == 25
        assert stub.WriteKV(
            pb.WriteKVRequest(seq_id=a, start_position=25, data=kv[25:].tobytes())
        ).num_tokens_written == 15
        whole = stub.ReadKV(pb.ReadKVRequest(seq_id=a))  # 0 tokens: to the end
        assert whole.num_tokens == 40 and whole.data == kv.tobytes()
        part = stub.ReadKV(pb.ReadKVRequest(seq_id=a, start_position=13, num_tokens=9))
        assert part.num_tokens == 9 and part.data == kv[13:22].tobytes()
        tail = stub.ReadKV(pb.ReadKVRequest(seq_id=a, start_position=30))
        assert tail.num_tokens == 10 and tail.data == kv[30:].tobytes()
        at_end = stub.ReadKV(pb.ReadKVRequest(seq_id=a, start_position=40))
        assert (at_end.num_tokens, at_end.data) == (0, b"")
        overwrite = token_kv(8, range(3))
        stub.WriteKV(pb.WriteKVRequest(seq_id=a, start_position=5, data=overwrite.tobytes()))
        expected = kv.copy()
        expected[5:8] = overwrite
        assert stub.ReadKV(pb.ReadKVRequest(seq_id=a)).data == expected.tobytes()


def test_check_invariants(any_server: ServerProcess) -> None:
    with connect(any_server.address) as stub:
        ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(5)]
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=ids, num_tokens=[3, 17, 1, 32, 9]))
        stub.Fork(pb.ForkRequest(parent_seq_id=ids[1], num_children=3))
        reply = stub.CheckInvariants(pb.CheckInvariantsRequest())
        assert reply == pb.CheckInvariantsResponse(ok=True, num_blocks_checked=NUM_BLOCKS, num_sequences_checked=8)


def test_health_and_reflection(any_server: ServerProcess) -> None:
    with grpc.insecure_channel(any_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvpool.v1.KVPoolService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == (
                health_pb2.HealthCheckResponse.SERVING
            )
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        list_services = reflection_pb2.ServerReflectionRequest(list_services="")
        replies = list(reflection.ServerReflectionInfo(iter([list_services])))
        names = {s.name for s in replies[0].list_services_response.service}
        assert {"kvpool.v1.KVPoolService", "grpc.health.v1.Health"} <= names
        replies = list(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvpool.v1.KVPoolService")])
        ))
        assert replies[0].file_descriptor_response.file_descriptor_proto
