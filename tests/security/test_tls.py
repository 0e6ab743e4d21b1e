"""TLS and mutual TLS on TCP, with certificates made in the test; a client certificate of another CA is refused."""

from __future__ import annotations

import grpc
import pytest

from kvpool_client import KVPoolClient
from tests.security.certs import CA
from tests.security.tenant_helpers import write_tokens


@pytest.fixture(scope="module")
def pki():
    ca, other = CA("kvpool test CA"), CA("someone else's CA")
    return ca, other, ca.issue("kvpool-server", server=True), ca.issue("frontend-a"), other.issue("frontend-a")


def _files(tmp_path, **pems):
    paths = {}
    for name, pem in pems.items():
        (tmp_path / name).write_bytes(pem)
        paths[name] = str(tmp_path / name)
    return paths


def _works(address, **kw) -> bool:
    try:
        with KVPoolClient(address, timeout=3, session=False, **kw) as client:
            client.stats()
        return True
    except Exception:
        return False


def test_tls_with_a_token(server_factory, tmp_path, pki):
    ca, _, (cert, key), _, _ = pki
    f = _files(tmp_path, cert=cert, key=key)
    tokens = write_tokens(tmp_path / "t.toml")
    server = server_factory("--tls-cert", f["cert"], "--tls-key", f["key"], "--auth-tokens", str(tokens),
                            credentials=grpc.ssl_channel_credentials(ca.pem))
    assert _works(server.address, tls_ca=ca.pem, token="tok-a")
    assert not _works(server.address, token="tok-a")  # plaintext to a TLS port
    assert not _works(server.address, tls_ca=CA("x").pem, token="tok-a")  # a server this CA did not sign
    with KVPoolClient(server.address, tls_ca=ca.pem, token="tok-a") as client:
        seq = client.register()
        assert client.append([seq], 3).slot_mapping.size == 3


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(server_factory, tmp_path, pki):
    ca, _, (cert, key), (client_cert, client_key), (other_cert, other_key) = pki
    f = _files(tmp_path, cert=cert, key=key, ca=ca.pem, client_cert=client_cert, client_key=client_key)
    good = grpc.ssl_channel_credentials(ca.pem, client_key, client_cert)
    server = server_factory("--tls-cert", f["cert"], "--tls-key", f["key"], "--tls-client-ca", f["ca"],
                            credentials=good)
    assert _works(server.address, tls_ca=ca.pem, tls_cert=f["client_cert"], tls_key=f["client_key"])
    assert not _works(server.address, tls_ca=ca.pem)  # no client certificate
    assert not _works(server.address, tls_ca=ca.pem, tls_cert=other_cert, tls_key=other_key)  # another CA's
