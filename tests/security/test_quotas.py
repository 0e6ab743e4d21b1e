"""Quotas: a tenant driven into its quota gets RESOURCE_EXHAUSTED naming it, and changes nothing; another tenant
keeps allocating. Reservations hold blocks back for their tenant."""

from __future__ import annotations

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.core import KVCacheManager
from kvpool_server.core.errors import InvariantViolationError, QuotaExceededError
from kvpool_server.core.tenants import TenantLimits
from tests.security.tenant_helpers import As, write_tokens

QUOTAS = """
[tenants.a]
max_blocks = 8
max_sequences = 4
max_sessions = 1
"""


def test_a_tenant_at_its_quota_is_refused_while_another_allocates(server_factory, tmp_path):
    server = server_factory("--auth-tokens", str(write_tokens(tmp_path / "t.toml", tenants=QUOTAS)))
    with grpc.insecure_channel(server.address) as channel:
        a, b = As(channel, "tok-a"), As(channel, "tok-b")
        seq = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[16 * 7]))  # 7 of 8 blocks
        with pytest.raises(grpc.RpcError) as err:
            a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[32]))  # 2 more: over
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_blocks=8" in err.value.details()
        assert dict(err.value.trailing_metadata())["kvpool-error"] == "quota-exceeded"
        assert a.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq)).num_tokens == 16 * 7  # refused whole
        a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[16]))  # exactly to the quota: fine
        # copy-on-write copies count against the tenant that makes them
        child = a.Fork(pb.ForkRequest(parent_seq_id=seq, num_children=1)).child_seq_ids[0]
        with pytest.raises(grpc.RpcError) as err:
            a.AppendToken(pb.AppendTokenRequest(seq_ids=[child]))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = b.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        b.AppendToken(pb.AppendTokenRequest(seq_ids=[other], num_tokens=[16 * 40]))  # b is not limited
        for _ in range(2):
            a.RegisterSequence(pb.RegisterSequenceRequest())
        with pytest.raises(grpc.RpcError) as err:
            a.RegisterSequence(pb.RegisterSequenceRequest())  # a fifth sequence
        assert "max_sequences=4" in err.value.details()
        a.OpenSession(pb.OpenSessionRequest())
        with pytest.raises(grpc.RpcError) as err:
            a.OpenSession(pb.OpenSessionRequest())
        assert "max_sessions=1" in err.value.details()
        usage = a.Stats(pb.StatsRequest()).tenants[0]
        assert (usage.num_blocks, usage.max_blocks, usage.num_sequences, usage.num_sessions) == (8, 8, 4, 1)
        assert As(channel, "tok-admin").CheckInvariants(pb.CheckInvariantsRequest()).ok


def test_a_reservation_keeps_blocks_for_its_tenant():
    m = KVCacheManager(20, 4, tenancy=True)
    a, b = m.tenants.tenant_id("a"), m.tenants.tenant_id("b")
    m.tenants.set_limits(b, TenantLimits(reserved_blocks=5))
    noisy = m.register(tenant=a)
    m.append(noisy, 4 * 15, tenant=a)  # 15 blocks: all but b's 5
    with pytest.raises(QuotaExceededError, match="reserved"):
        m.append(noisy, 1, tenant=a)
    quiet = m.register(tenant=b)
    m.append(quiet, 4 * 5, tenant=b)  # b gets its reservation
    m.check_invariants()


def test_check_invariants_fires_on_a_corrupted_tenant_row():
    m = KVCacheManager(20, 4, tenancy=True)
    a, b = m.tenants.tenant_id("a"), m.tenants.tenant_id("b")
    seq = m.register(tenant=a)
    m.append(seq, 5, tenant=a)
    m.check_invariants()
    m.tenants.tenant_of_row[m.tenant_ids.row(a, seq)] = b
    with pytest.raises(InvariantViolationError, match="sequence counts"):
        m.check_invariants()


def test_per_tenant_usage_and_quota_refusals_are_exported_as_metrics(server_factory, tmp_path):
    import socket
    import urllib.request

    from tests.ops.test_metrics import scrape_text

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = server_factory("--auth-tokens", str(write_tokens(tmp_path / "t.toml", tenants=QUOTAS)),
                            "--metrics-address", f"127.0.0.1:{port}")
    with grpc.insecure_channel(server.address) as channel:
        a, b = As(channel, "tok-a"), As(channel, "tok-b")
        seq = a.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[16 * 8]))  # a: all 8 of its blocks
        with pytest.raises(grpc.RpcError):
            a.AppendToken(pb.AppendTokenRequest(seq_ids=[seq]))  # over max_blocks
        stream = a.AppendTokenStream(iter([pb.AppendTokenStreamRequest(seq_ids=[seq])]))  # the same, on a stream
        with pytest.raises(grpc.RpcError) as refused:
            list(stream)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = b.RegisterSequence(pb.RegisterSequenceRequest()).seq_id
        b.AppendToken(pb.AppendTokenRequest(seq_ids=[other], num_tokens=[40]))  # b: 3 blocks
    got = scrape_text(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode())
    assert got[("kvpool_tenant_blocks_used", (("tenant", "a"),))] == 8
    assert got[("kvpool_tenant_blocks_used", (("tenant", "b"),))] == 3
    assert got[("kvpool_tenant_sequences", (("tenant", "b"),))] == 1
    # one call scope for every kind (issue 19): the unary refusal and the stream message's are both counted
    assert got[("kvpool_quota_refusals_total", (("quota", "max_blocks"), ("tenant", "a")))] == 2
