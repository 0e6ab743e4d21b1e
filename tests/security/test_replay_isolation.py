"""Retries are per tenant (issue 20.2): a tenant replaying another tenant's request bytes and request id gets no
part of the other's answer, cannot burn the other's ids, and cannot evict the other's remembered answers. Real
server processes."""

from __future__ import annotations

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from tests.security.tenant_helpers import As, write_tokens


def test_a_tenant_replaying_another_tenants_request_gets_its_own_answer(server_factory, tmp_path):
    server = server_factory("--auth-tokens", str(write_tokens(tmp_path / "tokens.toml")))
    with grpc.insecure_channel(server.address) as channel:
        a, b = As(channel, "tok-a"), As(channel, "tok-b")
        request = pb.RegisterSequenceRequest(request_id=77)
        first = a.RegisterSequence(request).seq_id
        assert a.RegisterSequence(request).seq_id == first  # a's own retry: the first answer, applied once
        theirs = b.RegisterSequence(request).seq_id  # the same bytes from b: b's own new sequence
        assert theirs != first
        assert b.Stats(pb.StatsRequest()).tenants[0].num_sequences == 1
        # b used id 77 with other arguments: that is b's business, and a's retry still replays a's answer
        b.RegisterSequence(pb.RegisterSequenceRequest(request_id=78))
        assert b.Fork(pb.ForkRequest(parent_seq_id=theirs, num_children=1, request_id=79)).child_seq_ids
        assert a.RegisterSequence(request).seq_id == first


def test_another_tenants_requests_do_not_evict_a_remembered_answer(server_factory, tmp_path):
    """Windows are per tenant: b sending more request ids than a session's window (1,024) evicts none of a's."""
    server = server_factory("--auth-tokens", str(write_tokens(tmp_path / "tokens.toml")), "--num-blocks", "4096")
    with grpc.insecure_channel(server.address) as channel:
        a, b = As(channel, "tok-a"), As(channel, "tok-b")
        victim = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        lost = pb.AppendTokenRequest(seq_ids=[victim], num_tokens=[3], request_id=1)  # its reply "lost"
        slots = list(a.AppendToken(lost).slot_mapping)
        seq = b.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        for request_id in range(1, 1100):
            b.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], request_id=request_id))
        assert list(a.AppendToken(lost).slot_mapping) == slots  # a's retry: replayed, not applied again
        assert a.GetBlockTable(pb.GetBlockTableRequest(seq_id=victim)).num_tokens == 3
