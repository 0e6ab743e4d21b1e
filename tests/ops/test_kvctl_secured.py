"""kvctl against a secured server (issue 24.1, 24.4): --auth-tokens and mutual TLS, the token from a file or
KVPOOL_TOKEN, the TLS files from flags or KVPOOL_CLIENT_TLS_*; a token is never taken (nor repeated) from argv; a
failure to connect says what happened."""

from __future__ import annotations

import json

import grpc
import pytest

from kvpool_client.kvctl import EXIT_ERROR, EXIT_NO_SERVER, EXIT_USAGE, main
from tests.security.certs import CA
from tests.security.tenant_helpers import write_tokens


def kvctl(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse's usage errors
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def secured(server_factory, tmp_path, monkeypatch):
    """A server with tokens and mutual TLS; the files a client needs; an environment without KVPOOL_* leftovers."""
    for name in ("KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE", "KVPOOL_TARGET", "KVPOOL_CLIENT_TLS_CA",
                 "KVPOOL_CLIENT_TLS_CERT", "KVPOOL_CLIENT_TLS_KEY"):
        monkeypatch.delenv(name, raising=False)
    ca = CA("kvpool test CA")
    files = {}
    for name, pem in zip(("server.pem", "server.key"), ca.issue("kvpool-server", server=True), strict=True):
        files[name] = tmp_path / name
        files[name].write_bytes(pem)
    for name, pem in zip(("client.pem", "client.key"), ca.issue("frontend-a"), strict=True):
        files[name] = tmp_path / name
        files[name].write_bytes(pem)
    files["ca.pem"] = tmp_path / "ca.pem"
    files["ca.pem"].write_bytes(ca.pem)
    for name, token in (("admin-token", "tok-admin"), ("frontend-token", "tok-a")):
        files[name] = tmp_path / name
        files[name].write_text(token + "\n")
    files["tokens.toml"] = write_tokens(tmp_path / "tokens.toml")
    server = server_factory("--auth-tokens", str(files["tokens.toml"]), "--tls-cert", str(files["server.pem"]),
                            "--tls-key", str(files["server.key"]), "--tls-client-ca", str(files["ca.pem"]),
                            credentials=grpc.ssl_channel_credentials(ca.pem, files["client.key"].read_bytes(),
                                                                     files["client.pem"].read_bytes()))
    tls = ["--tls-ca", str(files["ca.pem"]), "--tls-cert", str(files["client.pem"]),
           "--tls-key", str(files["client.key"])]
    return server, {k: str(v) for k, v in files.items()}, tls


def test_every_command_with_a_token_file_and_mutual_tls(secured, capsys):
    server, files, tls = secured
    base = ["--target", server.address, *tls, "--token-file", files["admin-token"]]
    code, out, err = kvctl(capsys, *base, "stats", "--json")
    assert code == 0, err
    assert json.loads(out)["num_blocks_total"] == 256
    code, out, err = kvctl(capsys, *base, "sessions")
    assert code == 0 and "0 sessions" in out, err
    code, out, err = kvctl(capsys, *base, "sequences", "--json")
    assert code == 0 and json.loads(out)["sequences"] == [], err
    code, out, err = kvctl(capsys, *base, "health")
    assert code == 0 and "SERVING" in out, err
    code, out, err = kvctl(capsys, *base, "events", "--batches", "1", "--json")
    assert code == 0 and '"snapshot": true' in out, err
    code, out, err = kvctl(capsys, *base, "top", "--json", "--iterations", "1")
    assert code == 0 and json.loads(out.splitlines()[0])["blocks_total"] == 256, err
    # the options after the command name too
    code, out, err = kvctl(capsys, "stats", *base)
    assert code == 0 and "256" in out, err


def test_token_and_tls_files_from_the_environment(secured, capsys, monkeypatch):
    server, files, _ = secured
    monkeypatch.setenv("KVPOOL_CLIENT_TLS_CA", files["ca.pem"])
    monkeypatch.setenv("KVPOOL_CLIENT_TLS_CERT", files["client.pem"])
    monkeypatch.setenv("KVPOOL_CLIENT_TLS_KEY", files["client.key"])
    monkeypatch.setenv("KVPOOL_TOKEN", "tok-admin")
    code, out, err = kvctl(capsys, "--target", server.address, "sessions", "--json")
    assert code == 0 and json.loads(out)["sessions"] == [], err
    monkeypatch.delenv("KVPOOL_TOKEN")
    monkeypatch.setenv("KVPOOL_TOKEN_FILE", files["admin-token"])
    code, out, err = kvctl(capsys, "--target", server.address, "sessions", "--json")
    assert code == 0, err


def test_refusals_say_what_to_do(secured, capsys):
    server, files, tls = secured
    code, _, err = kvctl(capsys, "--target", server.address, *tls, "stats")
    assert code == EXIT_ERROR and "UNAUTHENTICATED" in err and "--token-file" in err
    code, _, err = kvctl(capsys, "--target", server.address, *tls, "--token-file", files["frontend-token"],
                         "sessions")
    assert code == EXIT_ERROR and "PERMISSION_DENIED" in err and "admin token" in err
    code, out, err = kvctl(capsys, "--target", server.address, *tls, "--token-file", files["frontend-token"],
                           "stats")
    assert code == 0, err  # a frontend token may read Stats


def test_connection_failures_name_their_cause(secured, capsys):
    server, files, tls = secured
    code, _, err = kvctl(capsys, "--target", server.address, "--token-file", files["admin-token"], "stats")
    assert code == EXIT_NO_SERVER and "serves TLS" in err and "--tls-ca" in err and "is it running" not in err
    code, _, err = kvctl(capsys, "--target", server.address, "--tls-ca", files["ca.pem"], "health")
    assert code == EXIT_NO_SERVER and "client certificate" in err and "--tls-cert" in err
    code, _, err = kvctl(capsys, "--target", server.address, "--tls-ca", files["client.pem"], "health")
    assert code == EXIT_NO_SERVER and "did not sign" in err


def test_a_token_on_the_command_line_is_refused_without_being_repeated(secured, capsys):
    server, _, tls = secured
    for argv in (["--token", "s3cret-t0ken", "stats"], ["stats", "--token", "s3cret-t0ken"],
                 ["--token=s3cret-t0ken", "stats"], ["--tok=s3cret-t0ken", "stats"],
                 ["--tokn", "s3cret-t0ken", "stats"]):
        code, out, err = kvctl(capsys, "--target", server.address, *tls, *argv)
        assert code == EXIT_USAGE, argv
        assert "s3cret-t0ken" not in out + err, argv
    code, _, err = kvctl(capsys, "--target", server.address, "--token", "s3cret-t0ken", "stats")
    assert "--token-file" in err and "KVPOOL_TOKEN" in err


def test_bad_credential_files_are_usage_errors(secured, capsys, tmp_path):
    server, files, tls = secured
    (tmp_path / "two-words").write_text("tok-a tok-b\n")
    (tmp_path / "empty").write_text("\n")
    for token_file, says in ((tmp_path / "two-words", "one token"), (tmp_path / "empty", "is empty"),
                             (tmp_path / "missing", "cannot read")):
        code, _, err = kvctl(capsys, "--target", server.address, *tls, "--token-file", str(token_file), "stats")
        assert code == EXIT_USAGE and says in err and str(token_file) in err
        assert "tok-a" not in err
    code, _, err = kvctl(capsys, "--target", server.address, "--tls-ca", files["ca.pem"], "--tls-cert",
                         files["client.pem"], "stats")
    assert code == EXIT_USAGE and "--tls-key" in err
    code, _, err = kvctl(capsys, "--target", server.address, "--tls-ca", files["admin-token"], "stats")
    assert code == EXIT_USAGE and "not PEM" in err


def test_a_socket_path_without_unix_and_a_refused_port(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    code, _, err = kvctl(capsys, "--target", str(tmp_path / "kvpool.sock"), "stats")
    assert code == EXIT_USAGE and f"unix:{tmp_path / 'kvpool.sock'}" in err
    code, _, err = kvctl(capsys, "--target", "127.0.0.1:1", "stats")
    assert code == EXIT_NO_SERVER and "connection refused" in err
    code, _, err = kvctl(capsys, "--unix-socket", str(tmp_path / "nothing.sock"), "stats")
    assert code == EXIT_NO_SERVER and "no unix socket at" in err


def test_tls_settings_in_the_environment_leave_a_unix_socket_alone(unix_server, capsys, monkeypatch, tmp_path):
    """The unix socket is never TLS: KVPOOL_CLIENT_TLS_* set for the TCP servers must not break it."""
    ca = tmp_path / "ca.pem"
    ca.write_bytes(CA("some CA").pem)
    monkeypatch.delenv("KVPOOL_TOKEN", raising=False)
    monkeypatch.setenv("KVPOOL_CLIENT_TLS_CA", str(ca))
    code, out, err = kvctl(capsys, "--target", unix_server.address, "stats", "--json")
    assert code == 0 and json.loads(out)["num_blocks_total"] == 256, err


def test_a_name_the_server_certificate_does_not_carry(secured, capsys):
    server, files, tls = secured
    code, _, err = kvctl(capsys, "--target", server.address, *tls, "--tls-server-name", "not-the-server", "health")
    assert code == EXIT_NO_SERVER and "--tls-server-name" in err, err
    code, out, err = kvctl(capsys, "--target", server.address, *tls, "--tls-server-name", "localhost", "health")
    assert code == 0 and "SERVING" in out, err


def test_a_key_given_as_the_ca_or_a_certificate_as_the_key(secured, capsys):
    """Issue 35 item 6: not "give the server's address" after a failed handshake, but which file is wrong."""
    server, files, _ = secured
    code, _, err = kvctl(capsys, "--target", server.address, "--tls-ca", files["client.key"], "health")
    assert code == EXIT_USAGE and f"--tls-ca {files['client.key']} holds a private key, not a certificate" in err
    code, _, err = kvctl(capsys, "--target", server.address, "--tls-ca", files["ca.pem"], "--tls-cert",
                         files["client.pem"], "--tls-key", files["client.pem"], "health")
    assert code == EXIT_USAGE and "--tls-key" in err and "holds no private key" in err


def test_a_server_name_mismatch_names_the_name(secured, capsys):
    server, _, tls = secured
    code, _, err = kvctl(capsys, "--target", server.address, *tls, "--tls-server-name", "not-the-server", "health")
    assert code == EXIT_NO_SERVER and "'not-the-server'" in err, err


def test_the_metrics_port_as_the_target(server_factory, capsys):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server_factory("--metrics-address", f"127.0.0.1:{port}")
    code, _, err = kvctl(capsys, "--target", f"127.0.0.1:{port}", "stats")
    assert code == EXIT_NO_SERVER and "answered in HTTP/1" in err and "metrics port" in err
    assert "Expected SETTINGS frame" not in err.split("(gRPC")[0]
