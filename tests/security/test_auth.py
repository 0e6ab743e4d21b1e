"""Identity: tokens, roles, SIGHUP revocation, the transport rules -- against real server processes."""

# ruff: noqa: B023  (each lambda is called within the iteration that made it)
from __future__ import annotations

import os
import signal
import stat
import time

import grpc
import pytest

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import KVPoolClient
from kvpool_server.config import ConfigError, load_config
from tests.security.tenant_helpers import TOKENS, As, code_of, write_tokens

U, P = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture
def auth_server(server_factory, tmp_path):
    tokens = write_tokens(tmp_path / "tokens.toml")
    return server_factory("--auth-tokens", str(tokens)), tokens


def test_missing_and_wrong_tokens_are_unauthenticated(auth_server):
    server, _ = auth_server
    with grpc.insecure_channel(server.address) as channel:
        for token in (None, "nope", ""):
            stub = As(channel, token)
            assert code_of(lambda: stub.RegisterSequence(pb.RegisterSequenceRequest())) == U
            assert code_of(lambda: stub.Stats(pb.StatsRequest())) == U
            assert code_of(lambda: stub.OpenSession(pb.OpenSessionRequest())) == U
        bad_scheme = pb.RegisterSequenceRequest()
        stub = pb_stub = As(channel, None).stub
        with pytest.raises(grpc.RpcError) as err:
            pb_stub.RegisterSequence(bad_scheme, metadata=(("authorization", "Basic tok-a"),), timeout=10)
        assert err.value.code() == U
        stream = stub.AppendTokenStream(iter([pb.AppendTokenStreamRequest(seq_ids=[1])]), timeout=10)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == U


def test_frontend_calling_admin_rpcs_is_permission_denied(auth_server):
    server, _ = auth_server
    with grpc.insecure_channel(server.address) as channel:
        a, admin = As(channel, "tok-a"), As(channel, "tok-admin")
        for rpc, request in (("ListSessions", pb.ListSessionsRequest()), ("ListSequences", pb.ListSequencesRequest()),
                             ("CheckInvariants", pb.CheckInvariantsRequest())):
            assert code_of(lambda: getattr(a, rpc)(request)) == P
            assert code_of(lambda: getattr(admin, rpc)(request)) == grpc.StatusCode.OK
        assert code_of(lambda: a.Stats(pb.StatsRequest())) == grpc.StatusCode.OK
        assert code_of(lambda: a.Drain(pb.DrainRequest())) == P  # last: an admin's drain refuses new sessions
        assert code_of(lambda: admin.Drain(pb.DrainRequest())) == grpc.StatusCode.OK


def test_sighup_revokes_a_token(auth_server):
    server, tokens = auth_server
    with grpc.insecure_channel(server.address) as channel:
        a, b = As(channel, "tok-a"), As(channel, "tok-b")
        assert code_of(lambda: a.RegisterSequence(pb.RegisterSequenceRequest())) == grpc.StatusCode.OK
        write_tokens(tokens, {k: v for k, v in TOKENS.items() if k != "a"})
        os.kill(server.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while code_of(lambda: a.Stats(pb.StatsRequest())) != U:
            assert time.monotonic() < deadline, "token a still accepted after SIGHUP"
            time.sleep(0.05)
        assert code_of(lambda: b.Stats(pb.StatsRequest())) == grpc.StatusCode.OK
        tokens.write_text("not [ toml")  # a broken file keeps the tokens loaded before
        os.kill(server.pid, signal.SIGHUP)
        time.sleep(0.3)
        assert code_of(lambda: b.Stats(pb.StatsRequest())) == grpc.StatusCode.OK
        assert server.proc.poll() is None


def test_the_client_library_carries_the_token_keep_alive_included(auth_server):
    server, _ = auth_server
    with KVPoolClient(server.address, token="tok-a", lease_ttl_s=0.5) as client:
        seq_id = client.register()
        client.append([seq_id], 20)
        time.sleep(1.2)  # past the lease: only the keep-alive (which must authenticate) keeps the session
        assert client.block_table(seq_id).num_tokens == 20
    with KVPoolClient(server.address, token="wrong") as client, pytest.raises(Exception) as err:
        client.register()
    assert "token" in str(err.value)


def test_describe_pool_hides_the_mapping_from_tenants_that_may_not_attach(server_factory, tmp_path):
    tokens = write_tokens(tmp_path / "t.toml", tenants="[tenants.b]\nmay_attach = true\n")
    server = server_factory("--auth-tokens", str(tokens))
    with grpc.insecure_channel(server.address) as channel:
        assert As(channel, "tok-a").DescribePool(pb.DescribePoolRequest()).shm_name == ""
        assert As(channel, "tok-a").DescribePool(pb.DescribePoolRequest()).layout.block_size == 16
        assert As(channel, "tok-b").DescribePool(pb.DescribePoolRequest()).shm_name != ""


def test_unix_socket_is_created_0600(unix_server):
    mode = stat.S_IMODE(os.stat(unix_server.address.removeprefix("unix:")).st_mode)
    assert mode == 0o600


def test_a_network_address_needs_auth_tls_or_insecure(tmp_path):
    with pytest.raises(ConfigError, match="--insecure"):
        load_config(["--address", "0.0.0.0:0"], environ={})
    assert load_config(["--address", "0.0.0.0:0", "--insecure"], environ={}).insecure
    assert load_config(["--address", "0.0.0.0:0"], environ={"KVPOOL_INSECURE": "1"}).insecure
    tokens = write_tokens(tmp_path / "t.toml")
    assert load_config(["--address", "0.0.0.0:0", "--auth-tokens", str(tokens)], environ={}).auth_tokens
    assert load_config(["--address", "127.0.0.1:0"], environ={}).address  # loopback: as before
    with pytest.raises(ConfigError, match="go together"):
        load_config(["--tls-cert", str(tokens)], environ={})
