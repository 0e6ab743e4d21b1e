"""A bind that fails says why (issue 24.4): a port in use, an address not of this host, a missing directory, a
socket path too long -- not "address in use?" for every one."""

from __future__ import annotations

import socket

from kvpool_server.grpc_api.bind_errors import why_bind_failed
from tests.service.test_service_lifecycle import run_server


def test_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"port {port} is in use" in why_bind_failed(f"127.0.0.1:{port}")


def test_an_address_not_of_this_host():
    message = why_bind_failed("192.0.2.1:50051")  # TEST-NET-1: nobody's
    assert "not an address of this host" in message and "in use" not in message


def test_unix_socket_paths(tmp_path):
    message = why_bind_failed(f"unix:{tmp_path}/no/such/dir/kvpool.sock")
    assert "does not exist" in message and "mkdir -p" in message and "in use" not in message
    assert "at most 107" in why_bind_failed("unix:/tmp/" + "x" * 120)
    assert "is a directory" in why_bind_failed(f"unix:{tmp_path}")


def test_the_server_names_the_cause(tmp_path):
    result = run_server("--address", "", "--unix-socket", str(tmp_path / "missing" / "kvpool.sock"))
    assert result.returncode != 0
    assert "the directory" in result.stderr and "does not exist" in result.stderr, result.stderr
    assert "address in use" not in result.stderr
