"""Requests refused by their size before any parsing (issue 30, item 10): a prompt of millions of tokens is answered
INVALID_ARGUMENT from its body's length alone -- against a real server -- while every valid request, however it is
encoded (packed or not, the largest token ids), still parses; the bounds themselves follow the limits."""

from __future__ import annotations

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_server.grpc_api.request_bounds import UNKNOWN_FIELDS_BYTES, field_limits, max_request_bytes

MAX_SEQ_LEN = 1024
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def unpacked_prompt(tokens: list[int]) -> bytes:
    """A RegisterSequenceRequest with prompt_token_ids (field 4) unpacked: a key before every token."""
    return b"".join(varint(4 << 3) + varint(t) for t in tokens)


@pytest.fixture
def stub_channel(server_factory):
    server = server_factory("--max-seq-len", str(MAX_SEQ_LEN), "--max-message-bytes", "16MiB")
    with grpc.insecure_channel(server.address, options=UNLIMITED) as channel:
        yield pb_grpc.KVPoolServiceStub(channel), channel


def test_a_prompt_of_millions_of_tokens_is_refused_by_its_size(stub_channel):
    stub, channel = stub_channel
    body = pb.RegisterSequenceRequest(prompt_token_ids=[7] * 8_000_000).SerializeToString()
    register = channel.unary_unary("/kvpool.v1.KVPoolService/RegisterSequence")
    with pytest.raises(grpc.RpcError) as error:
        register(body, timeout=60)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error.value.details()
    assert "the request is 8,000,005 bytes, more than any valid one" in details  # its length, not its tokens
    assert "prompt_token_ids at most 1,024 (--max-seq-len)" in details and "refused unread" in details
    assert stub.Stats(pb.StatsRequest()).num_sequences == 0  # nothing applied
    stub.CheckInvariants(pb.CheckInvariantsRequest())


def test_an_append_stream_message_over_its_bound_is_refused_unread(stub_channel):
    stub, _ = stub_channel
    seq = stub.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
    huge = pb.AppendTokenStreamRequest(seq_ids=[seq], num_tokens=[1], token_ids=[3] * 4_000_000)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.AppendTokenStream(iter([huge]), timeout=60))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "AppendTokenStream: the request is" in error.value.details()
    assert stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).num_tokens == 0


def test_just_over_max_seq_len_still_gets_the_exact_message(stub_channel):
    stub, _ = stub_channel
    with pytest.raises(grpc.RpcError) as error:
        stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=[1] * (MAX_SEQ_LEN + 1)))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"prompt_token_ids has {MAX_SEQ_LEN + 1} tokens, over max_seq_len={MAX_SEQ_LEN}" in error.value.details()


def test_the_largest_valid_prompts_parse_packed_or_not(stub_channel):
    stub, channel = stub_channel
    largest = [2**32 - 1 - i for i in range(MAX_SEQ_LEN)]  # 5-byte varints
    seq = stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=largest,
                                                           cache_extra_key=b"k" * 256)).seq_id
    assert seq
    register = channel.unary_unary("/kvpool.v1.KVPoolService/RegisterSequence")
    reply = pb.RegisterSequenceResponse.FromString(register(unpacked_prompt(largest) + b"\x32\x01k", timeout=30))
    assert reply.seq_id and reply.seq_id != seq


def test_bounds_follow_the_limits():
    limits = field_limits(max_seq_len=1000, max_batch=10, max_tokens_per_call=100)
    register = max_request_bytes(pb.RegisterSequenceRequest.DESCRIPTOR, limits)
    assert register is not None and 1000 * 11 < register.num_bytes - UNKNOWN_FIELDS_BYTES < 1000 * 11 + 400
    assert max_request_bytes(pb.WriteKVRequest.DESCRIPTOR, limits) is None  # data: the byte budget's
    stats = max_request_bytes(pb.StatsRequest.DESCRIPTOR, limits)
    assert stats is not None and stats.num_bytes == UNKNOWN_FIELDS_BYTES  # room for a newer client's fields
    bigger = max_request_bytes(pb.AppendTokenRequest.DESCRIPTOR,
                               field_limits(max_seq_len=1000, max_batch=10, max_tokens_per_call=200))
    smaller = max_request_bytes(pb.AppendTokenRequest.DESCRIPTOR, limits)
    assert bigger is not None and smaller is not None and bigger.num_bytes - smaller.num_bytes == 100 * 11
