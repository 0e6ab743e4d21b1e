"""Public prefixes and extra keys through a real server with tokens (docs/prefix-caching.md, docs/security.md):
tenant b starts from tenant a's sealed public blocks and reads a's KV; a tenant without share_prefixes is
PERMISSION_DENIED and nothing changes; bad fields are INVALID_ARGUMENT; different extra keys never share."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import KVPoolClient
from kvpool_server.core.block_hash import chain_hashes
from tests.security.tenant_helpers import As, code_of, write_tokens
from tests.service.service_helpers import BLOCK_SIZE, token_kv

SYSTEM = [(11 * i) % 30_000 for i in range(2 * BLOCK_SIZE)]  # a public system prompt: two full blocks
PROMPT = SYSTEM + [40_000 + i for i in range(BLOCK_SIZE + 3)]  # then the tenant's own block and 3 more tokens
TOKENS = {"a": ("tok-a", "frontend"), "b": ("tok-b", "frontend"), "c": ("tok-c", "frontend"),
          "ops": ("tok-admin", "admin")}
SHARING = """
[tenants.a]
share_prefixes = true
[tenants.b]
share_prefixes = true
"""


def prefill(stub: As, extra: bytes = b"") -> tuple[int, int]:
    """Register PROMPT with SYSTEM public, append the rest with ids, write its KV, one decode step (sealing)."""
    reply = stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM),
                                                             cache_extra_key=extra))
    seq, cached = reply.seq_id, reply.num_cached_tokens
    stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[len(PROMPT) - cached], token_ids=PROMPT[cached:]))
    stub.WriteKV(pb.WriteKVRequest(seq_id=seq, start_position=cached,
                                   data=token_kv(seq, range(cached, len(PROMPT))).tobytes()))
    stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], token_ids=[1]))
    return seq, cached


@pytest.fixture
def sharing_server(server_factory, tmp_path: Path):
    return server_factory("--auth-tokens", str(write_tokens(tmp_path / "tokens.toml", TOKENS, SHARING)))


def test_a_public_prefix_is_shared_across_tenants_with_the_first_writers_kv(sharing_server) -> None:
    with grpc.insecure_channel(sharing_server.address) as channel:
        a, b, admin = As(channel, "tok-a"), As(channel, "tok-b"), As(channel, "tok-admin")
        seq_a, cached = prefill(a)
        assert cached == 0
        table_a = a.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_a))
        assert list(table_a.block_hashes)[:3] == chain_hashes(PROMPT, BLOCK_SIZE, b"a", num_public=2)
        kv_a = a.ReadKV(pb.ReadKVRequest(seq_id=seq_a, num_tokens=len(SYSTEM))).data

        with KVPoolClient(sharing_server.address, token="tok-b", session=False) as client:  # the library's arguments
            seq_b, cached = client.register_prompt(PROMPT, public_prefix_len=len(SYSTEM))
        assert cached == len(SYSTEM)  # a's two public blocks; a's own third block is not b's
        table_b = b.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq_b))
        assert list(table_b.block_ids) == list(table_a.block_ids)[:2]  # the same physical blocks
        assert b.ReadKV(pb.ReadKVRequest(seq_id=seq_b, num_tokens=len(SYSTEM))).data == kv_a
        assert code_of(lambda: b.WriteKV(pb.WriteKVRequest(seq_id=seq_b, start_position=0, data=kv_a[:512]))) == \
            grpc.StatusCode.FAILED_PRECONDITION  # a sealed block's KV is immutable, for every tenant
        usage = {t.tenant: t.num_blocks for t in admin.Stats(pb.StatsRequest()).tenants}
        assert (usage["a"], usage["b"]) == (4, 2)  # each tenant is charged for the shared blocks it holds
        assert admin.CheckInvariants(pb.CheckInvariantsRequest()).ok

        a.Free(pb.FreeRequest(seq_ids=[seq_a]))  # b still holds the public blocks: its KV stays
        assert b.ReadKV(pb.ReadKVRequest(seq_id=seq_b, num_tokens=len(SYSTEM))).data == kv_a
        assert b.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).num_cached_tokens == 0
        different_key = pb.RegisterSequenceRequest(prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM),
                                                   cache_extra_key=b"lora:other")
        assert b.RegisterSequence(different_key).num_cached_tokens == 0
        assert admin.CheckInvariants(pb.CheckInvariantsRequest()).ok


def test_a_tenant_without_share_prefixes_is_denied_and_nothing_changes(sharing_server) -> None:
    with grpc.insecure_channel(sharing_server.address) as channel:
        a, c, admin = As(channel, "tok-a"), As(channel, "tok-c"), As(channel, "tok-admin")
        prefill(a)
        before = admin.Stats(pb.StatsRequest())
        public = pb.RegisterSequenceRequest(prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM))
        with pytest.raises(grpc.RpcError) as err:
            c.RegisterSequence(public)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "share_prefixes" in err.value.details()
        assert admin.Stats(pb.StatsRequest()) == before
        assert c.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT)).num_cached_tokens == 0


def test_bad_public_prefix_or_extra_key_is_invalid_and_changes_nothing(sharing_server) -> None:
    with grpc.insecure_channel(sharing_server.address) as channel:
        b, admin = As(channel, "tok-b"), As(channel, "tok-admin")
        before = admin.Stats(pb.StatsRequest())
        for request in (pb.RegisterSequenceRequest(prompt_token_ids=PROMPT, public_prefix_len=len(PROMPT) + 1),
                        pb.RegisterSequenceRequest(public_prefix_len=1),
                        pb.RegisterSequenceRequest(prompt_token_ids=PROMPT, cache_extra_key=bytes(257))):
            assert code_of(lambda r=request: b.RegisterSequence(r)) == grpc.StatusCode.INVALID_ARGUMENT
        assert admin.Stats(pb.StatsRequest()) == before
        key = bytes(range(256))  # the longest key, and a sequence that shares with its own key only
        seq, _ = prefill(b, extra=key)
        reply = b.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM),
                                                              cache_extra_key=key))
        assert reply.num_cached_tokens == len(PROMPT) - 3
        table = b.GetBlockTable(pb.GetBlockTableRequest(seq_id=seq))
        assert list(table.block_hashes)[:3] == chain_hashes(PROMPT, BLOCK_SIZE, b"b", extra=key, num_public=2)
