"""Isolation: tenant A, calling with its own valid token, against tenant B's sequences and sessions. Every call is
NOT_FOUND -- never PERMISSION_DENIED, which would confirm that the id exists -- and B's tables, KV and Stats stay
exactly as they were."""

# ruff: noqa: B023  (each lambda is called within the iteration that made it)
from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from tests.security.tenant_helpers import As, code_of, write_tokens

NF = grpc.StatusCode.NOT_FOUND


@pytest.fixture
def two_tenants(server_factory, tmp_path):
    server = server_factory("--auth-tokens", str(write_tokens(tmp_path / "tokens.toml")))
    channel = grpc.insecure_channel(server.address)
    yield As(channel, "tok-a"), As(channel, "tok-b"), As(channel, "tok-admin")
    channel.close()


def _b_state(b, seq_ids):
    tables = [b.GetBlockTable(pb.GetBlockTableRequest(seq_id=s)) for s in seq_ids]
    kv = [b.ReadKV(pb.ReadKVRequest(seq_id=s)).data for s in seq_ids]
    return [(list(t.block_ids), t.num_tokens) for t in tables], kv, list(b.Stats(pb.StatsRequest()).tenants)


def test_tenant_a_cannot_touch_tenant_b(two_tenants):
    a, b, admin = two_tenants
    session = b.OpenSession(pb.OpenSessionRequest(client_name="b")).session_id
    b1 = b.RegisterSequence(pb.RegisterSequenceRequest(session_id=session)).seq_id
    b2 = b.RegisterSequence(pb.RegisterSequenceRequest(seq_id=777)).seq_id  # caller-chosen, sessionless
    b.AppendToken(pb.AppendTokenRequest(seq_ids=[b1, b2], num_tokens=[20], session_id=session))
    token_bytes = b.DescribePool(pb.DescribePoolRequest()).layout.token_bytes
    b.WriteKV(pb.WriteKVRequest(seq_id=b1, data=np.arange(20 * token_bytes // 4, dtype=np.float32).tobytes(),
                                session_id=session))
    mine = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
    before = _b_state(b, [b1, b2])

    for victim in (b1, b2):
        calls = {
            "GetBlockTable": lambda: a.GetBlockTable(pb.GetBlockTableRequest(seq_id=victim)),
            "ReadKV": lambda: a.ReadKV(pb.ReadKVRequest(seq_id=victim)),
            "ReadKV range": lambda: a.ReadKV(pb.ReadKVRequest(seq_id=victim, start_position=0, num_tokens=4)),
            "WriteKV": lambda: a.WriteKV(pb.WriteKVRequest(seq_id=victim, data=b"\0" * token_bytes)),
            "Fork": lambda: a.Fork(pb.ForkRequest(parent_seq_id=victim, num_children=1)),
            "Free": lambda: a.Free(pb.FreeRequest(seq_ids=[victim])),
            "Free with own": lambda: a.Free(pb.FreeRequest(seq_ids=[mine, victim])),
            "AppendToken": lambda: a.AppendToken(pb.AppendTokenRequest(seq_ids=[victim])),
            "AppendToken batch": lambda: a.AppendToken(pb.AppendTokenRequest(seq_ids=[mine, victim], num_tokens=[3])),
            "AppendTokenStream": lambda: list(
                a.AppendTokenStream(iter([pb.AppendTokenStreamRequest(seq_ids=[victim])]))),
        }
        for name, call in calls.items():
            assert code_of(call) == NF, name
    session_calls = {
        "RegisterSequence in B's session": lambda: a.RegisterSequence(pb.RegisterSequenceRequest(session_id=session)),
        "Fork into B's session": lambda: a.Fork(pb.ForkRequest(parent_seq_id=mine, num_children=1, session_id=session)),
        "CloseSession": lambda: a.CloseSession(pb.CloseSessionRequest(session_id=session)),
        "KeepAlive": lambda: list(a.KeepAlive(iter([pb.KeepAliveRequest(session_id=session)]))),
        "Free in B's session": lambda: a.Free(pb.FreeRequest(seq_ids=[mine], session_id=session)),
    }
    for name, call in session_calls.items():
        assert code_of(call) == NF, name
    # an id that does not exist reads the same as B's
    missing = code_of(lambda: a.GetBlockTable(pb.GetBlockTableRequest(seq_id=778)))
    assert missing == NF

    assert _b_state(b, [b1, b2]) == before
    assert a.GetBlockTable(pb.GetBlockTableRequest(seq_id=mine)).num_tokens == 0  # A's own batch half not applied
    assert admin.CheckInvariants(pb.CheckInvariantsRequest()).ok
    listed = {s.seq_id for s in admin.ListSequences(pb.ListSequencesRequest()).sequences}
    assert {b1, b2, mine} <= listed


def test_stats_show_a_frontend_its_own_tenant_and_an_admin_every_tenant(two_tenants):
    a, b, admin = two_tenants
    seq = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
    a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[33]))
    b.RegisterSequence(pb.RegisterSequenceRequest())
    stats_a = a.Stats(pb.StatsRequest())
    assert [(t.tenant, t.num_sequences, t.num_blocks) for t in stats_a.tenants] == [("a", 1, 3)]
    assert stats_a.num_blocks_used == 3 and stats_a.num_blocks_total == 256  # the pool's totals
    assert [t.tenant for t in b.Stats(pb.StatsRequest()).tenants] == ["b"]
    assert {t.tenant for t in admin.Stats(pb.StatsRequest()).tenants} == {"a", "b", "ops"}


def test_ids_are_per_tenant_and_reveal_nothing_across_tenants(two_tenants):
    """No existence oracle (issue 20): b choosing an id a holds gets OK, not ALREADY_EXISTS, and its own sequence;
    and a's server ids count up by one from call to call, whatever b registered in between."""
    a, b, admin = two_tenants
    exists = grpc.StatusCode.ALREADY_EXISTS
    assert a.RegisterSequence(pb.RegisterSequenceRequest(seq_id=4242)).seq_id == 4242
    assert b.RegisterSequence(pb.RegisterSequenceRequest(seq_id=4242)).seq_id == 4242
    assert code_of(lambda: b.RegisterSequence(pb.RegisterSequenceRequest(seq_id=4242))) == exists  # b's own
    a.AppendToken(pb.AppendTokenRequest(seq_ids=[4242], num_tokens=[5]))
    assert b.GetBlockTable(pb.GetBlockTableRequest(seq_id=4242)).num_tokens == 0  # two sequences
    assert list(a.Fork(pb.ForkRequest(parent_seq_id=4242, child_seq_ids=[5000])).child_seq_ids) == [5000]
    assert list(b.Fork(pb.ForkRequest(parent_seq_id=4242, child_seq_ids=[5000])).child_seq_ids) == [5000]
    assert code_of(lambda: b.Fork(pb.ForkRequest(parent_seq_id=4242, child_seq_ids=[5000]))) == exists
    b.Free(pb.FreeRequest(seq_ids=[4242, 5000]))
    assert a.GetBlockTable(pb.GetBlockTableRequest(seq_id=5000)).num_tokens == 5  # a's child, untouched

    first, second = (a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id for _ in range(2))
    for _ in range(40):
        b.RegisterSequence(pb.RegisterSequenceRequest())
    third = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
    assert third - second == second - first  # b's 40 registrations do not show
    assert admin.CheckInvariants(pb.CheckInvariantsRequest()).ok
