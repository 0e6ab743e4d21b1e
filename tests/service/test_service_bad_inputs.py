"""The bad-input matrix: each RPC x {unknown id, duplicate id, zero / negative / huge counts, fork of a freed
sequence, double free, empty batch, oversized batch, pool exhausted} answers the exact status code, and nothing
observable changes: the whole Stats response, every block table and every byte of KV are the same afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from tests.conftest import start_server
from tests.service.service_helpers import (
    TOKEN_BYTES,
    connect,
    expect_error,
    field_varint,
    raw_call,
    snapshot,
    token_kv,
)

from kvpool.v1 import kvpool_pb2 as pb

C = grpc.StatusCode
NEG = -1  # a negative int sent on the wire (as 2**64 - 1); unsigned fields read it as their maximum
MAX_BATCH = 8
FREE_BLOCKS_AFTER_SETUP = 32 - 2 - 1 - 1 - 9  # A (shared with B), C, D, E


@dataclass
class World:
    """The module server's sequences: A (20 tokens, KV written) forked into B (sharing A's 2 blocks), C (16 tokens),
    D (caller id 77, 3 tokens), E (130 tokens: too long to read in one message), F (registered then freed)."""

    address: str
    ids: dict[str, int]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory):
    server = start_server(
        tmp_path_factory.mktemp("bad"),
        "--num-blocks", "32", "--max-batch", str(MAX_BATCH), "--max-seq-len", "1024",
        "--max-num-seqs", "64", "--max-message-bytes", "65536",
    )
    try:
        with connect(server.address) as stub:
            ids = {}
            for name in "ACEF":
                ids[name] = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
            ids["D"] = stub.RegisterSequence(pb.RegisterSequenceRequest(seq_id=77)).seq_id
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=[ids[n] for n in "ACDEF"], num_tokens=[20, 16, 3, 130, 5]))
            for name, count in (("A", 20), ("C", 16), ("D", 3)):
                stub.WriteKV(pb.WriteKVRequest(seq_id=ids[name], data=token_kv(ids[name], range(count)).tobytes()))
            ids["B"] = stub.Fork(pb.ForkRequest(parent_seq_id=ids["A"], num_children=1)).child_seq_ids[0]
            stub.Free(pb.FreeRequest(seq_ids=[ids["F"]]))
            stats = stub.Stats(pb.StatsRequest())
            assert stats.num_blocks_free == FREE_BLOCKS_AFTER_SETUP, stats
        yield World(server.address, ids)
    finally:
        assert server.stop() == 0


@dataclass
class Case:
    rpc: str
    request: Callable[[dict[str, int]], Any]  # ids -> request message, or bytes for a raw call
    code: grpc.StatusCode


_RESPONSES = {
    "RegisterSequence": pb.RegisterSequenceResponse, "AppendToken": pb.AppendTokenResponse,
    "Fork": pb.ForkResponse, "Free": pb.FreeResponse, "GetBlockTable": pb.GetBlockTableResponse,
    "WriteKV": pb.WriteKVResponse, "ReadKV": pb.ReadKVResponse,
}
UNKNOWN = 987_654_321  # never registered


def append(ids_of: Callable[[dict[str, int]], list[int]], counts: list[int] | None = None) -> Callable:
    return lambda ids: pb.AppendTokenRequest(seq_ids=ids_of(ids), num_tokens=counts or [])


def write(name: str, start: int, num_tokens: int, extra_bytes: int = 0) -> Callable:
    return lambda ids: pb.WriteKVRequest(
        seq_id=ids.get(name, UNKNOWN) if name != "0" else 0, start_position=start,
        data=token_kv(1, range(num_tokens)).tobytes() + b"\0" * extra_bytes,
    )


CASES: dict[str, Case] = {
    # RegisterSequence
    "register/duplicate-id": Case(
        "RegisterSequence", lambda ids: pb.RegisterSequenceRequest(seq_id=ids["D"]), C.ALREADY_EXISTS
    ),
    "register/duplicate-server-id": Case(
        "RegisterSequence", lambda ids: pb.RegisterSequenceRequest(seq_id=ids["A"]), C.ALREADY_EXISTS
    ),
    "register/zero-id": Case("RegisterSequence", lambda ids: pb.RegisterSequenceRequest(seq_id=0), C.INVALID_ARGUMENT),
    "register/huge-id": Case(
        "RegisterSequence", lambda ids: pb.RegisterSequenceRequest(seq_id=2**64 - 1), C.INVALID_ARGUMENT
    ),
    "register/negative-id": Case("RegisterSequence", lambda ids: field_varint(1, NEG), C.INVALID_ARGUMENT),
    # AppendToken
    "append/unknown-id": Case("AppendToken", append(lambda ids: [UNKNOWN]), C.NOT_FOUND),
    "append/unknown-after-valid": Case("AppendToken", append(lambda ids: [ids["C"], ids["D"], UNKNOWN]), C.NOT_FOUND),
    "append/freed-id": Case("AppendToken", append(lambda ids: [ids["C"], ids["F"]]), C.NOT_FOUND),
    "append/unknown-server-range-id": Case("AppendToken", append(lambda ids: [ids["A"] + (1 << 40)]), C.NOT_FOUND),
    "append/max-uint64-id": Case("AppendToken", append(lambda ids: [ids["C"], 2**64 - 1]), C.NOT_FOUND),
    "append/zero-id": Case("AppendToken", append(lambda ids: [ids["C"], 0]), C.INVALID_ARGUMENT),
    "append/duplicate-id": Case("AppendToken", append(lambda ids: [ids["C"], ids["D"], ids["C"]]), C.INVALID_ARGUMENT),
    "append/empty-batch": Case("AppendToken", append(lambda ids: []), C.INVALID_ARGUMENT),
    "append/empty-batch-with-counts": Case("AppendToken", append(lambda ids: [], [3]), C.INVALID_ARGUMENT),
    "append/oversized-batch": Case(
        "AppendToken", append(lambda ids: list(range(1, MAX_BATCH + 2))), C.INVALID_ARGUMENT
    ),
    "append/zero-count": Case("AppendToken", append(lambda ids: [ids["C"]], [0]), C.INVALID_ARGUMENT),
    "append/zero-count-among-many": Case(
        "AppendToken", append(lambda ids: [ids["C"], ids["D"]], [2, 0]), C.INVALID_ARGUMENT
    ),
    "append/negative-count": Case(
        "AppendToken", lambda ids: field_varint(1, ids["C"]) + field_varint(2, NEG), C.INVALID_ARGUMENT
    ),
    "append/huge-count": Case("AppendToken", append(lambda ids: [ids["C"]], [2**32 - 1]), C.INVALID_ARGUMENT),
    "append/over-max-seq-len": Case(
        "AppendToken", append(lambda ids: [ids["C"], ids["D"]], [1, 1022]), C.INVALID_ARGUMENT
    ),
    "append/count-list-too-short": Case(
        "AppendToken", append(lambda ids: [ids["C"], ids["D"], ids["A"]], [1, 2]), C.INVALID_ARGUMENT
    ),
    "append/count-list-too-long": Case(
        "AppendToken", append(lambda ids: [ids["C"], ids["D"]], [1, 2, 3]), C.INVALID_ARGUMENT
    ),
    "append/pool-exhausted": Case("AppendToken", append(lambda ids: [ids["C"]], [500]), C.RESOURCE_EXHAUSTED),
    "append/pool-exhausted-batch": Case(
        "AppendToken", append(lambda ids: [ids["C"], ids["D"]], [200, 300]), C.RESOURCE_EXHAUSTED
    ),
    "append/pool-exhausted-with-cow": Case(
        "AppendToken", append(lambda ids: [ids["B"], ids["A"]], [12, 310]), C.RESOURCE_EXHAUSTED
    ),
    # Fork
    "fork/unknown-parent": Case("Fork", lambda ids: pb.ForkRequest(parent_seq_id=UNKNOWN, num_children=1), C.NOT_FOUND),
    "fork/freed-parent": Case("Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["F"], num_children=2), C.NOT_FOUND),
    "fork/zero-parent": Case("Fork", lambda ids: pb.ForkRequest(parent_seq_id=0, num_children=1), C.INVALID_ARGUMENT),
    "fork/zero-children": Case("Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["A"]), C.INVALID_ARGUMENT),
    "fork/negative-children": Case(
        "Fork", lambda ids: field_varint(1, ids["A"]) + field_varint(2, NEG), C.INVALID_ARGUMENT
    ),
    "fork/huge-children": Case(
        "Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["A"], num_children=2**32 - 1), C.INVALID_ARGUMENT
    ),
    "fork/oversized-child-ids": Case(
        "Fork",
        lambda ids: pb.ForkRequest(parent_seq_id=ids["A"], child_seq_ids=range(1000, 1001 + MAX_BATCH)),
        C.INVALID_ARGUMENT,
    ),
    "fork/child-id-live": Case(
        "Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["A"], child_seq_ids=[500, ids["D"]]), C.ALREADY_EXISTS
    ),
    "fork/child-id-is-parent": Case(
        "Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["D"], child_seq_ids=[ids["D"]]), C.ALREADY_EXISTS
    ),
    "fork/duplicate-child-ids": Case(
        "Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["A"], child_seq_ids=[500, 500]), C.INVALID_ARGUMENT
    ),
    "fork/zero-child-id": Case(
        "Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["A"], child_seq_ids=[500, 0]), C.INVALID_ARGUMENT
    ),
    "fork/count-mismatch": Case(
        "Fork",
        lambda ids: pb.ForkRequest(parent_seq_id=ids["A"], num_children=3, child_seq_ids=[500, 501]),
        C.INVALID_ARGUMENT,
    ),
    # Free
    "free/unknown-id": Case("Free", lambda ids: pb.FreeRequest(seq_ids=[UNKNOWN]), C.NOT_FOUND),
    "free/unknown-after-valid": Case(
        "Free", lambda ids: pb.FreeRequest(seq_ids=[ids["C"], ids["B"], UNKNOWN]), C.NOT_FOUND
    ),
    "free/double-free": Case("Free", lambda ids: pb.FreeRequest(seq_ids=[ids["F"]]), C.NOT_FOUND),
    "free/double-free-in-batch": Case("Free", lambda ids: pb.FreeRequest(seq_ids=[ids["C"], ids["F"]]), C.NOT_FOUND),
    "free/duplicate-id": Case("Free", lambda ids: pb.FreeRequest(seq_ids=[ids["C"], ids["C"]]), C.INVALID_ARGUMENT),
    "free/zero-id": Case("Free", lambda ids: pb.FreeRequest(seq_ids=[ids["C"], 0]), C.INVALID_ARGUMENT),
    "free/empty-batch": Case("Free", lambda ids: pb.FreeRequest(), C.INVALID_ARGUMENT),
    "free/oversized-batch": Case(
        "Free", lambda ids: pb.FreeRequest(seq_ids=range(1, MAX_BATCH + 2)), C.INVALID_ARGUMENT
    ),
    # GetBlockTable
    "table/unknown-id": Case("GetBlockTable", lambda ids: pb.GetBlockTableRequest(seq_id=UNKNOWN), C.NOT_FOUND),
    "table/freed-id": Case("GetBlockTable", lambda ids: pb.GetBlockTableRequest(seq_id=ids["F"]), C.NOT_FOUND),
    "table/zero-id": Case("GetBlockTable", lambda ids: pb.GetBlockTableRequest(), C.INVALID_ARGUMENT),
    # WriteKV
    "write/unknown-id": Case("WriteKV", write("unknown", 0, 1), C.NOT_FOUND),
    "write/freed-id": Case("WriteKV", write("F", 0, 1), C.NOT_FOUND),
    "write/zero-id": Case("WriteKV", write("0", 0, 1), C.INVALID_ARGUMENT),
    "write/empty-data": Case("WriteKV", write("C", 0, 0), C.INVALID_ARGUMENT),
    "write/partial-token": Case("WriteKV", write("C", 0, 1, extra_bytes=4), C.INVALID_ARGUMENT),
    "write/short-token": Case(
        "WriteKV", lambda ids: pb.WriteKVRequest(seq_id=ids["C"], data=b"\0" * (TOKEN_BYTES - 4)), C.INVALID_ARGUMENT
    ),
    "write/past-end": Case("WriteKV", write("C", 15, 2), C.INVALID_ARGUMENT),
    "write/start-at-end": Case("WriteKV", write("D", 3, 1), C.INVALID_ARGUMENT),
    "write/huge-start": Case("WriteKV", write("C", 2**32 - 1, 1), C.INVALID_ARGUMENT),
    "write/negative-start": Case(
        "WriteKV",
        lambda ids: field_varint(1, ids["C"]) + field_varint(2, NEG) + b"\x1a\x80\x04" + b"\0" * TOKEN_BYTES,
        C.INVALID_ARGUMENT,
    ),
    "write/shared-block": Case("WriteKV", write("B", 16, 2), C.FAILED_PRECONDITION),
    "write/shared-block-of-parent": Case("WriteKV", write("A", 0, 1), C.FAILED_PRECONDITION),
    "write/over-message-limit": Case("WriteKV", write("E", 0, 130), C.RESOURCE_EXHAUSTED),
    # ReadKV
    "read/unknown-id": Case("ReadKV", lambda ids: pb.ReadKVRequest(seq_id=UNKNOWN, num_tokens=1), C.NOT_FOUND),
    "read/unknown-id-to-end": Case("ReadKV", lambda ids: pb.ReadKVRequest(seq_id=UNKNOWN), C.NOT_FOUND),
    "read/freed-id": Case("ReadKV", lambda ids: pb.ReadKVRequest(seq_id=ids["F"]), C.NOT_FOUND),
    "read/zero-id": Case("ReadKV", lambda ids: pb.ReadKVRequest(num_tokens=1), C.INVALID_ARGUMENT),
    "read/past-end": Case(
        "ReadKV", lambda ids: pb.ReadKVRequest(seq_id=ids["C"], start_position=10, num_tokens=7), C.INVALID_ARGUMENT
    ),
    "read/start-past-end-to-end": Case(
        "ReadKV", lambda ids: pb.ReadKVRequest(seq_id=ids["C"], start_position=17), C.INVALID_ARGUMENT
    ),
    "read/huge-count": Case(
        "ReadKV", lambda ids: pb.ReadKVRequest(seq_id=ids["C"], num_tokens=2**32 - 1), C.INVALID_ARGUMENT
    ),
    "read/negative-start": Case(
        "ReadKV", lambda ids: field_varint(1, ids["C"]) + field_varint(2, NEG) + field_varint(3, 1), C.INVALID_ARGUMENT
    ),
    "read/over-message-limit": Case("ReadKV", lambda ids: pb.ReadKVRequest(seq_id=ids["E"]), C.INVALID_ARGUMENT),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_has_exact_code_and_changes_nothing(world: World, name: str) -> None:
    case = CASES[name]
    request = case.request(world.ids)
    with connect(world.address) as stub:
        watched = [*world.ids.values(), 500, 501, UNKNOWN]
        before = snapshot(stub, watched)
        if isinstance(request, bytes):
            call = raw_call(stub.channel, case.rpc, _RESPONSES[case.rpc])
        else:
            call = getattr(stub, case.rpc)
        expect_error(call, request, case.code)
        after = snapshot(stub, watched)
        assert after == before
        stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_every_rpc_with_input_is_in_the_matrix() -> None:
    covered = {case.rpc for case in CASES.values()}
    assert covered == set(_RESPONSES)


# ---------------------------------------------------------------------------------------------- a full pool
@pytest.fixture(scope="module")
def full_world(tmp_path_factory: pytest.TempPathFactory):
    """4 blocks and 4 sequence rows, all taken: 4 sequences of 16 tokens (one full block each)."""
    server = start_server(tmp_path_factory.mktemp("full"), "--num-blocks", "4", "--max-num-seqs", "4")
    try:
        with connect(server.address) as stub:
            ids = [stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(4)]
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=ids, num_tokens=[16]))
            stats = stub.Stats(pb.StatsRequest())
            assert (stats.num_blocks_free, stats.num_sequences) == (0, 4)
        yield World(server.address, {str(i): seq_id for i, seq_id in enumerate(ids)})
    finally:
        assert server.stop() == 0


FULL_CASES: dict[str, Case] = {
    "register": Case("RegisterSequence", lambda ids: pb.RegisterSequenceRequest(), C.RESOURCE_EXHAUSTED),
    "register-caller-id": Case(
        "RegisterSequence", lambda ids: pb.RegisterSequenceRequest(seq_id=UNKNOWN), C.RESOURCE_EXHAUSTED
    ),
    "fork": Case("Fork", lambda ids: pb.ForkRequest(parent_seq_id=ids["0"], num_children=1), C.RESOURCE_EXHAUSTED),
    "append-one": Case("AppendToken", append(lambda ids: [ids["0"]]), C.RESOURCE_EXHAUSTED),
    "append-all": Case("AppendToken", append(lambda ids: list(ids.values())), C.RESOURCE_EXHAUSTED),
}


@pytest.mark.parametrize("name", list(FULL_CASES))
def test_pool_exhausted_has_exact_code_and_changes_nothing(full_world: World, name: str) -> None:
    case = FULL_CASES[name]
    with connect(full_world.address) as stub:
        before = snapshot(stub, list(full_world.ids.values()))
        expect_error(getattr(stub, case.rpc), case.request(full_world.ids), case.code)
        assert snapshot(stub, list(full_world.ids.values())) == before
        stub.CheckInvariants(pb.CheckInvariantsRequest())
