"""The client library explains a failed connection as kvctl does (issue 35 item 3): each failure is a
ConnectionFailedError (an UnavailableError) whose message names the cause and the fix in the library's words
(diagnose.LIBRARY), against real server processes and real sockets. Permanent ones are not retried."""

from __future__ import annotations

import socket

import grpc
import pytest

from kvpool_client import ConnectionFailedError, InvalidArgumentError, KVPoolClient, UnavailableError
from tests.conftest import start_server
from tests.security.certs import CA


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pki")
    ca = CA("kvpool connect-errors CA")
    files = {}
    for stem, (pem, key) in (("server", ca.issue("kvpool-server", server=True)), ("client", ca.issue("frontend"))):
        files[f"{stem}.pem"], files[f"{stem}.key"] = tmp / f"{stem}.pem", tmp / f"{stem}.key"
        files[f"{stem}.pem"].write_bytes(pem)
        files[f"{stem}.key"].write_bytes(key)
    files["ca.pem"] = tmp / "ca.pem"
    files["ca.pem"].write_bytes(ca.pem)
    files["other-ca.pem"] = tmp / "other-ca.pem"
    files["other-ca.pem"].write_bytes(CA("another CA").pem)
    return {k: str(v) for k, v in files.items()}


@pytest.fixture(scope="module")
def tls_server(pki, tmp_path_factory):
    """Mutual TLS: the server asks for a client certificate signed by its client CA (one for the module)."""
    with open(pki["ca.pem"], "rb") as ca, open(pki["client.key"], "rb") as key, open(pki["client.pem"], "rb") as cert:
        creds = grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())
    server = start_server(tmp_path_factory.mktemp("tls-server"), "--tls-cert", pki["server.pem"], "--tls-key",
                          pki["server.key"], "--tls-client-ca", pki["ca.pem"], credentials=creds)
    yield server
    server.stop()


def failure(target: str, **kwargs) -> ConnectionFailedError:
    with pytest.raises(ConnectionFailedError) as caught:
        with KVPoolClient(target, timeout=5, session=False, **kwargs) as kv:
            kv.stats()
    assert isinstance(caught.value, UnavailableError)  # what callers caught before still catches it
    return caught.value


def test_a_socket_path_without_unix_names_the_unix_target(tmp_path):
    with pytest.raises(InvalidArgumentError, match=rf'a unix socket is named "unix:{tmp_path}/kvpool.sock"'):
        KVPoolClient(str(tmp_path / "kvpool.sock"))


def test_nothing_listening_on_a_port():
    with socket.socket() as bound:  # bound, never listening: a real refusal
        bound.bind(("127.0.0.1", 0))
        error = failure(f"127.0.0.1:{bound.getsockname()[1]}")
    assert "nothing listens" in error.details and "is kvpool-server running" in error.details
    assert 'KVPoolClient("unix:PATH")' in error.details and not error.permanent  # it may be starting
    assert "Connection refused" in error.grpc_details


def test_no_socket_at_a_unix_path_and_a_file_that_is_not_one(tmp_path):
    error = failure(f"unix:{tmp_path}/kvpool.sock")
    assert f"no unix socket at {tmp_path}/kvpool.sock" in error.details and not error.permanent
    (tmp_path / "file").write_text("")
    error = failure(f"unix:{tmp_path}/file")
    assert "is not a unix socket (a regular file)" in error.details and error.permanent


def test_plaintext_to_a_tls_port(tls_server):
    error = failure(tls_server.address)
    assert "it serves TLS" in error.details and "tls_ca=" in error.details and error.permanent


def test_tls_to_a_plaintext_port(server, pki):
    error = failure(server.address, tls_ca=pki["ca.pem"])
    assert "does not speak TLS" in error.details and "leave out tls_ca" in error.details and error.permanent


def test_a_missing_client_certificate(tls_server, pki):
    error = failure(tls_server.address, tls_ca=pki["ca.pem"])
    assert "asks for a client certificate" in error.details and "tls_cert= and tls_key=" in error.details


def test_a_ca_that_did_not_sign_the_servers_certificate(tls_server, pki):
    error = failure(tls_server.address, tls_ca=pki["other-ca.pem"], tls_cert=pki["client.pem"],
                    tls_key=pki["client.key"])
    assert "did not sign" in error.details and "tls_ca=" in error.details


def test_the_metrics_port_given_as_the_target(server_factory):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server_factory("--metrics-address", f"127.0.0.1:{port}")
    error = failure(f"127.0.0.1:{port}")
    assert "answered in HTTP/1" in error.details and "metrics port" in error.details and error.permanent


def test_the_right_credentials_connect(tls_server, pki):
    with KVPoolClient(tls_server.address, tls_ca=pki["ca.pem"], tls_cert=pki["client.pem"],
                      tls_key=pki["client.key"], session=False) as kv:
        assert kv.stats().num_blocks_total == 256


def test_the_async_client_explains_too(tls_server):
    import asyncio

    from kvpool_client import AsyncKVPoolClient

    async def main():
        async with AsyncKVPoolClient(tls_server.address, timeout=5, session=False) as kv:
            with pytest.raises(ConnectionFailedError, match="it serves TLS"):
                await kv.stats()

    asyncio.run(main())
