"""kvpool-loadgen against a secured server (issue 24.1, 24.2, 24.4): the token from a file, mutual TLS on every
connection (driver, workers, sampler, event counter); a --token-file is never silently ignored; a tenant that may
not attach, a draining server and a TLS server spoken to in plaintext are each told apart."""

from __future__ import annotations

import grpc
import pytest

from kvpool_client.kvctl import main as kvctl
from tests.loadgen.test_loadgen_e2e import POOL, loadgen
from tests.security.certs import CA
from tests.security.tenant_helpers import write_tokens

RUN = ("--processes", "1", "--concurrency", "2", "--completions", "4", "--max-len", "64", "--seed", "3")
TENANTS = "[tenants.a]\nmay_attach = true\n"  # b may not attach (the default); ops is an admin


@pytest.fixture
def secured(server_factory, tmp_path, monkeypatch):
    for name in ("KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE", "KVPOOL_ADMIN_TOKEN", "KVPOOL_ADMIN_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    ca = CA("kvpool test CA")
    server_cert, server_key = ca.issue("kvpool-server", server=True)
    client_cert, client_key = ca.issue("frontend-a")
    for name, data in (("ca.pem", ca.pem), ("server.pem", server_cert), ("server.key", server_key),
                       ("client.pem", client_cert), ("client.key", client_key), ("token-a", b"tok-a\n"),
                       ("token-b", b"tok-b\n"), ("admin-token", b"tok-admin\n")):
        (tmp_path / name).write_bytes(data)
    server = server_factory(*POOL, "--auth-tokens", str(write_tokens(tmp_path / "tokens.toml", tenants=TENANTS)),
                            "--tls-cert", str(tmp_path / "server.pem"), "--tls-key", str(tmp_path / "server.key"),
                            "--tls-client-ca", str(tmp_path / "ca.pem"),
                            credentials=grpc.ssl_channel_credentials(ca.pem, client_key, client_cert))
    tls = ("--tls-ca", str(tmp_path / "ca.pem"), "--tls-cert", str(tmp_path / "client.pem"),
           "--tls-key", str(tmp_path / "client.key"))
    return server, tls


def test_a_run_with_a_token_file_over_mutual_tls(secured, tmp_path):
    server, tls = secured
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, *tls, "--token-file", str(tmp_path / "token-a"),
                                  "--admin-token-file", str(tmp_path / "admin-token"))
    assert rc == 0, output
    assert summary["ok"] and summary["run"]["completions"] == 4 and summary["verification"]["errors"] == 0
    assert summary["end"]["invariants_checked"] and summary["end"]["invariants_ok"]
    assert f"token from {tmp_path / 'token-a'}" in output and "TLS (CA" in output
    assert "tok-a" not in output and "tok-a" not in str(summary) and "tok-admin" not in str(summary)


def test_a_token_file_is_never_silently_ignored(secured, tmp_path):
    server, tls = secured
    (tmp_path / "tenants.txt").write_text("a tok-a\nb tok-b\n")
    rc, _, output = loadgen(server.address, tmp_path, *RUN, *tls, "--token-file", str(tmp_path / "tenants.txt"))
    assert rc == 2 and "one token" in output and "--tenants" in output and "tok-a" not in output


def test_tokens_are_refused_on_the_command_line_without_being_repeated(secured, tmp_path):
    server, tls = secured
    for option in ("--token", "--admin-token"):
        rc, _, output = loadgen(server.address, tmp_path, *RUN, *tls, option, "s3cret-t0ken")
        assert rc == 2 and "s3cret-t0ken" not in output and "file" in output, output


def test_a_tenant_that_may_not_attach_runs_over_grpc_or_is_told_before_the_run(secured, tmp_path):
    server, tls = secured
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, *tls, "--token-file", str(tmp_path / "token-b"))
    assert rc == 0, output  # --kv-path auto: WriteKV / ReadKV, said in the dashboard
    assert summary["ok"] and summary["verification"]["errors"] == 0 and summary["verification"]["tokens_verified"]
    assert summary["kv_path"]["path"] == "grpc" and "may not attach" in summary["kv_path"]["why"][0]
    assert "KV over gRPC (WriteKV / ReadKV)" in output and summary["verification"]["method"].startswith("ReadKV")
    rc, _, output = loadgen(server.address, tmp_path, *RUN, *tls, "--token-file", str(tmp_path / "token-b"),
                            "--kv-path", "attach")
    assert rc == 2 and "may not attach" in output and "may_attach = true" in output, output
    assert "Errno" not in output and "Traceback" not in output


def test_plaintext_to_a_tls_server_says_so_at_once(secured, tmp_path):
    server, _ = secured
    rc, _, output = loadgen(server.address, tmp_path, *RUN, "--token-file", str(tmp_path / "token-a"),
                            "--connect-timeout", "60")
    assert rc == 2 and "serves TLS" in output and "--tls-ca" in output  # at once: --connect-timeout is 60 s


def test_a_draining_server_is_called_draining(server, tmp_path):
    assert kvctl(["--target", server.address, "drain"]) == 0
    rc, _, output = loadgen(server.address, tmp_path, *RUN, "--connect-timeout", "0.5")
    assert rc == 2 and "NOT_SERVING" in output and "draining" in output and "is it running" not in output


def test_a_socket_path_without_unix(tmp_path):
    rc, _, output = loadgen(str(tmp_path / "kvpool.sock"), tmp_path, *RUN)
    assert rc == 2 and f"unix:{tmp_path / 'kvpool.sock'}" in output


def test_a_non_admin_token_as_the_admin_token_is_named(secured, tmp_path):
    """Issue 35 item 6: not "CheckInvariants needs --admin-token" (no such flag) but what is wrong with the token."""
    server, tls = secured
    rc, summary, output = loadgen(server.address, tmp_path, *RUN, *tls, "--token-file", str(tmp_path / "token-a"),
                                  "--admin-token-file", str(tmp_path / "token-b"))
    assert rc == 0 and not summary["end"]["invariants_checked"], output
    assert f"the token of {tmp_path / 'token-b'} is not an admin's" in output and "--admin-token)" not in output


def test_a_wrong_token_gets_a_hint(secured, tmp_path):
    server, tls = secured
    (tmp_path / "wrong-token").write_text("tok-nobody\n")
    rc, _, output = loadgen(server.address, tmp_path, *RUN, *tls, "--token-file", str(tmp_path / "wrong-token"))
    assert rc == 2 and "UNAUTHENTICATED" in output
    assert f"the server does not know the token from {tmp_path / 'wrong-token'}" in output and "tok-nobody" not in output
