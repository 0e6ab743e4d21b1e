"""Copy-on-write seen through the data: the server copies a shared partial block before it replies.

    parent A: [X full | Y: 4 tokens]     fork -> B shares X and Y
    B appends 3: Y is copied to Z first, B's tokens 20..22 land in Z   (A keeps Y)
    A appends 2: Y is A's alone now, written in place                  (no copy)
"""

from __future__ import annotations

import numpy as np

from kvpool.v1 import kvpool_pb2 as pb
from tests.conftest import ServerProcess
from tests.service.service_helpers import BLOCK_SIZE, connect, token_kv


def read(stub, seq_id: int, start: int = 0, num_tokens: int = 0) -> bytes:
    return stub.ReadKV(pb.ReadKVRequest(seq_id=seq_id, start_position=start, num_tokens=num_tokens)).data


def table(stub, seq_id: int) -> list[int]:
    return list(stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_id)).block_ids)


def test_child_appending_into_shared_partial_block(server: ServerProcess) -> None:
    with connect(server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[20]))
        a_kv = token_kv(1, range(20))
        stub.WriteKV(pb.WriteKVRequest(seq_id=a, data=a_kv.tobytes()))
        b = stub.Fork(pb.ForkRequest(parent_seq_id=a, num_children=1)).child_seq_ids[0]
        x, y = table(stub, a)
        assert table(stub, b) == [x, y]

        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[b], num_tokens=[3]))
        assert len(reply.copies) == 1 and reply.copies[0].src_block_id == y
        z = reply.copies[0].dst_block_id
        assert z not in (x, y) and list(reply.new_block_ids) == [z]
        assert list(reply.slot_mapping) == [z * BLOCK_SIZE + off for off in (4, 5, 6)]
        assert table(stub, b) == [x, z] and table(stub, a) == [x, y]
        # The copy ran before the reply: B's first 20 tokens already read as A's, the copied part included.
        assert read(stub, b) == a_kv.tobytes() + bytes(3 * a_kv[0].nbytes)  # new slots of a fresh pool are 0
        b_new = token_kv(2, range(20, 23))
        stub.WriteKV(pb.WriteKVRequest(seq_id=b, start_position=20, data=b_new.tobytes()))

        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[2]))
        assert len(reply.copies) == 0 and list(reply.new_block_ids) == []
        assert list(reply.slot_mapping) == [y * BLOCK_SIZE + 4, y * BLOCK_SIZE + 5]  # in place: Y is A's alone
        a_new = token_kv(3, range(20, 22))
        stub.WriteKV(pb.WriteKVRequest(seq_id=a, start_position=20, data=a_new.tobytes()))

        assert read(stub, a) == np.concatenate([a_kv, a_new]).tobytes()
        assert read(stub, b) == np.concatenate([a_kv, b_new]).tobytes()
        stats = stub.Stats(pb.StatsRequest())
        assert (stats.num_copies, stats.num_blocks_shared, stats.num_blocks_used) == (1, 1, 3)
        stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_many_children_appending_in_one_batch(server: ServerProcess) -> None:
    """k sharers appending together make k - 1 copies; every copy holds the parent's KV."""
    with connect(server.address) as stub:
        a = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[a], num_tokens=[37]))
        a_kv = token_kv(5, range(37))
        stub.WriteKV(pb.WriteKVRequest(seq_id=a, data=a_kv.tobytes()))
        children = list(stub.Fork(pb.ForkRequest(parent_seq_id=a, num_children=3)).child_seq_ids)
        everyone = [a, *children]
        shared_last = table(stub, a)[2]
        reply = stub.AppendToken(pb.AppendTokenRequest(seq_ids=everyone, num_tokens=[1, 2, 3, 4]))
        assert len(reply.copies) == 3
        assert {c.src_block_id for c in reply.copies} == {shared_last}
        assert table(stub, children[-1])[2] == shared_last  # the last sharer in the batch writes in place
        new_kv = {}
        for i, (seq_id, count) in enumerate(zip(everyone, [1, 2, 3, 4])):
            assert read(stub, seq_id, 0, 37) == a_kv.tobytes()
            new_kv[seq_id] = token_kv(10 + i, range(37, 37 + count))
            stub.WriteKV(pb.WriteKVRequest(seq_id=seq_id, start_position=37, data=new_kv[seq_id].tobytes()))
        for seq_id in everyone:
            assert read(stub, seq_id) == np.concatenate([a_kv, new_kv[seq_id]]).tobytes()
        last_blocks = [table(stub, s)[2] for s in everyone]
        assert len(set(last_blocks)) == 4
        assert [table(stub, s)[:2] for s in everyone] == [table(stub, a)[:2]] * 4  # full blocks stay shared
