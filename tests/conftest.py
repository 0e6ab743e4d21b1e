"""Shared fixtures: real ``kvpool-server`` processes on port 0 or a unix socket.

``start_server(tmp_path, *extra_args, unix=False)`` starts the console script (or ``python -m kvpool_server`` when the
script is not installed next to this interpreter), waits until gRPC health says SERVING, and returns a
ServerProcess. Fixtures ``server`` (TCP) and ``unix_server`` give a small host-memory pool (256 blocks of the seed
layout, 2 MiB) and stop it after the test; ``server_factory`` starts servers with any flags and stops them all.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.private_shm import PrivateShm

SMALL_POOL_ARGS: tuple[str, ...] = ("--backend", "host", "--pool-bytes", str(256 * 8192))
STARTUP_TIMEOUT_S = 20.0


def server_command() -> list[str]:
    """The console script beside this interpreter, else ``python -m kvpool_server``."""
    script = Path(sys.executable).with_name("kvpool-server")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "kvpool_server"]


class ServerProcess:
    """A running kvpool-server subprocess. ``address`` is a gRPC target (``127.0.0.1:PORT`` or ``unix:PATH``)."""

    def __init__(self, proc: subprocess.Popen, address: str, log_path: Path, socket_dir: str | None) -> None:
        self.proc = proc
        self.address = address
        self.log_path = log_path
        self._socket_dir = socket_dir

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def port(self) -> int | None:
        if self.address.startswith("unix:"):
            return None
        return int(self.address.rsplit(":", 1)[1])

    def log(self) -> str:
        """Everything the server wrote to stdout and stderr so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``sig`` and wait for the exit; returns the exit code (killed and raises if it does not exit)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"server {self.pid} did not exit {timeout}s after signal {sig}:\n{self.log()}")
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_serving(
    address: str, proc: subprocess.Popen | None = None, timeout: float = STARTUP_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Poll gRPC health until the server answers SERVING (raises if ``proc`` exits first or time runs out).
    ``credentials``: a TLS server's (health needs no token)."""
    deadline = time.monotonic() + timeout
    channel_ = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel_ as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server at {address} not SERVING after {timeout}s")
            time.sleep(0.05)


def start_server(
    tmp_path: Path, *extra_args: str, unix: bool = False, env: dict[str, str] | None = None,
    credentials: grpc.ChannelCredentials | None = None, prefix: list[str] | None = None,
) -> ServerProcess:
    """Start kvpool-server on port 0 (or a unix socket) with ``extra_args``; return once it is SERVING.

    Defaults to the small host pool unless ``extra_args`` name ``--backend`` / ``--pool-bytes`` themselves.
    ``prefix``: a command that runs it (``PrivateShm.prefix``: inside a test's own /dev/shm).
    """
    tmp_path = Path(tmp_path)
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = list(extra_args)
    if "--backend" not in args:
        args += ["--backend", "host"]
    if "--pool-bytes" not in args and "--num-blocks" not in args:
        args += ["--pool-bytes", SMALL_POOL_ARGS[3]]
    socket_dir = None
    fd, port_file_name = tempfile.mkstemp(prefix="port-", dir=tmp_path)
    os.close(fd)
    port_file = Path(port_file_name)
    if unix:
        socket_dir = tempfile.mkdtemp(prefix="kvp-", dir="/tmp")  # sun_path is at most 107 bytes
        socket_path = os.path.join(socket_dir, "kvpool.sock")
        args += ["--unix-socket", socket_path, "--address", ""]
    else:
        args += ["--address", "127.0.0.1:0", "--port-file", str(port_file)]
    log_path = tmp_path / f"server-{time.monotonic_ns()}.log"
    proc_env = dict(os.environ)
    proc_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        proc_env.update(env)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            (prefix or []) + server_command() + args, stdout=log, stderr=subprocess.STDOUT, env=proc_env,
            start_new_session=True,
        )
    try:
        if unix:
            address = f"unix:{socket_path}"
        else:
            address = f"127.0.0.1:{_wait_port(port_file, proc)}"
        wait_serving(address, proc, credentials=credentials)
    except BaseException:
        proc.kill()
        proc.wait()
        if socket_dir:
            shutil.rmtree(socket_dir, ignore_errors=True)
        raise RuntimeError(f"kvpool-server failed to start ({' '.join(args)}):\n{log_path.read_text(errors='replace')}")
    return ServerProcess(proc, address, log_path, socket_dir)


def _wait_port(port_file: Path, proc: subprocess.Popen, timeout: float = STARTUP_TIMEOUT_S) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = port_file.read_text().strip()
        if text.isdigit():  # the server writes the file atomically (rename)
            return int(text)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before writing its port")
        time.sleep(0.02)
    raise TimeoutError(f"no port in {port_file} after {timeout}s")


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """``server_factory(*args, unix=False)`` starts a server; all are stopped (SIGTERM, then kill) at teardown."""
    started: list[ServerProcess] = []

    def factory(*extra_args: str, unix: bool = False, env: dict[str, str] | None = None,
                credentials: grpc.ChannelCredentials | None = None, prefix: list[str] | None = None) -> ServerProcess:
        proc = start_server(tmp_path, *extra_args, unix=unix, env=env, credentials=credentials, prefix=prefix)
        started.append(proc)
        return proc

    yield factory
    for proc in started:
        try:
            proc.stop()
        except RuntimeError:
            proc.kill()


@pytest.fixture
def private_shm() -> Iterator[PrivateShm]:
    """A 64 MiB /dev/shm of the test's own (tests/private_shm.py; skipped, with the reason, where it cannot be
    mounted). Servers started in it keep it until they stop."""
    shm = PrivateShm("64m")
    yield shm
    shm.close()


@pytest.fixture
def server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """A kvpool-server on 127.0.0.1, port 0, host backend, 256 blocks of 16 tokens x 512 bytes."""
    return server_factory()


@pytest.fixture
def unix_server(server_factory: Callable[..., ServerProcess]) -> ServerProcess:
    """The same small server on a unix socket."""
    return server_factory(unix=True)
