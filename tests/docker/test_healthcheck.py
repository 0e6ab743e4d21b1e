"""docker/healthcheck.py against real gRPC health servers (in this process) on TCP and on a unix socket."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.docker.parsing import REPO

SCRIPT = REPO / "docker" / "healthcheck.py"


def _load_module():
    spec = importlib.util.spec_from_file_location("kvpool_docker_healthcheck", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hc = _load_module()


class HealthServer:
    def __init__(self, address: str) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        self.servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port(address)
        self.server.start()

    def set(self, status: int, service: str = "") -> None:
        self.servicer.set(service, status)

    def stop(self) -> None:
        self.server.stop(grace=None)


@pytest.fixture
def tcp_server():
    server = HealthServer("127.0.0.1:0")
    server.set(health_pb2.HealthCheckResponse.SERVING)
    yield server
    server.stop()


@pytest.fixture
def unix_server():
    directory = tempfile.mkdtemp(prefix="kvpool-hc-", dir="/tmp")  # short: unix socket paths are limited to ~107
    path = f"{directory}/kvpool.sock"
    server = HealthServer("unix:" + path)
    server.set(health_pb2.HealthCheckResponse.SERVING)
    yield server, path
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)


def test_serving_server_is_healthy(tcp_server, capsys):
    assert hc.main([f"127.0.0.1:{tcp_server.port}"], {}) == 0
    assert "SERVING" in capsys.readouterr().out


def test_not_serving_server_is_unhealthy(tcp_server, capsys):
    tcp_server.set(health_pb2.HealthCheckResponse.NOT_SERVING)
    assert hc.main([f"127.0.0.1:{tcp_server.port}"], {}) == 1
    assert "NOT_SERVING" in capsys.readouterr().out


def test_unknown_service_is_unhealthy(tcp_server, capsys):
    assert hc.main([f"127.0.0.1:{tcp_server.port}"], {"KVPOOL_HEALTH_SERVICE": "no.such.Service"}) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_nothing_listening_fails_within_the_deadline(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    assert hc.main([f"127.0.0.1:{port}"], {"KVPOOL_HEALTH_TIMEOUT_S": "1"}) == 1
    assert time.monotonic() - started < 10
    out = capsys.readouterr().out
    assert "UNAVAILABLE" in out or "DEADLINE_EXCEEDED" in out


def test_server_settings_lead_to_the_unix_socket(unix_server):
    _, path = unix_server
    environ = {"KVPOOL_ADDRESS": "0.0.0.0:50051", "KVPOOL_UNIX_SOCKET": path}  # as compose sets them
    assert hc.health_target([], environ) == "unix:" + path
    assert hc.main([], environ) == 0


def test_server_settings_lead_to_loopback_tcp(tcp_server):
    assert hc.main([], {"KVPOOL_ADDRESS": f"0.0.0.0:{tcp_server.port}"}) == 0


@pytest.mark.parametrize(
    ("address", "target"),
    [("0.0.0.0:50051", "127.0.0.1:50051"), ("[::]:50051", "[::1]:50051"), (":50051", "127.0.0.1:50051"),
     ("10.1.2.3:7000", "10.1.2.3:7000"), ("localhost:50051", "localhost:50051")],
)
def test_wildcard_hosts_become_loopback(address, target):
    assert hc.loopback_target(address) == target


def test_target_precedence():
    environ = {"KVPOOL_HEALTH_TARGET": "a:1", "KVPOOL_UNIX_SOCKET": "/s", "KVPOOL_ADDRESS": "0.0.0.0:2"}
    assert hc.health_target(["cli:3"], environ) == "cli:3"
    assert hc.health_target([], environ) == "a:1"
    assert hc.health_target([], {"KVPOOL_UNIX_SOCKET": "/s", "KVPOOL_ADDRESS": "0.0.0.0:2"}) == "unix:/s"
    assert hc.health_target([], {}) == hc.DEFAULT_ADDRESS


@pytest.mark.parametrize("environ", [{"KVPOOL_ADDRESS": "0.0.0.0:0"}, {"KVPOOL_ADDRESS": ""},
                                     {"KVPOOL_ADDRESS": "nohost"}, {"KVPOOL_HEALTH_TIMEOUT_S": "soon"}])
def test_unusable_settings_are_unhealthy_not_a_crash(environ, capsys):
    assert hc.main([], environ) == 1
    assert capsys.readouterr().out.startswith("healthcheck: ")


def test_runs_as_docker_runs_it(tcp_server):
    """As the image's HEALTHCHECK does: the script as a program, exit status and one line of output."""
    result = subprocess.run([sys.executable, str(SCRIPT), f"127.0.0.1:{tcp_server.port}"], capture_output=True,
                            text=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"127.0.0.1:{tcp_server.port}: SERVING"


def test_script_is_self_contained():
    """Only the standard library, grpcio and grpcio-health-checking: it runs in every image."""
    imports = {line.split()[1].split(".")[0] for line in SCRIPT.read_text().splitlines()
               if line.strip().startswith(("import ", "from "))}
    assert imports <= {"__future__", "os", "sys", "collections", "grpc", "grpc_health"}, imports
    assert Path(SCRIPT).read_text().startswith("#!/usr/bin/env python3")
