"""kvpool-server: create_server() builds and binds everything; serve() runs it until SIGTERM/SIGINT.

Shutdown (``shutdown()``), in order: health goes NOT_SERVING, new calls are refused with UNAVAILABLE while calls
already running go on, the server stops listening and in-flight calls get ``shutdown_grace_s`` to finish, then
the pool is closed (shared memory unlinked / GPU memory freed) and the process exits 0.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool.v1 import kvpool_pb2, kvpool_pb2_grpc
from kvpool_server.config import ConfigError, ServerConfig, configure_logging, load_config
from kvpool_server.core import KVCacheManager, KVPoolError
from kvpool_server.device import create_pool
from kvpool_server.service import KVPoolServicer

logger = logging.getLogger("kvpool_server")
SERVICE_NAME = kvpool_pb2.DESCRIPTOR.services_by_name["KVPoolService"].full_name
DRAIN_QUIET_S = 0.2  # shutdown stops draining once no call has been refused for this long


class StartupError(RuntimeError):
    """The server cannot start (address in use, no GPU, ...); the message says why."""


class ServerHandle(NamedTuple):
    server: grpc.Server
    port: int | None  # the bound TCP port (None when only a unix socket is used)
    pool: Any
    servicer: KVPoolServicer
    health: health.HealthServicer


def grpc_options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]


def create_server(config: ServerConfig) -> ServerHandle:
    """Allocate the pool, build the gRPC server (KVPoolService, health, reflection), bind it and start it.

    Raises StartupError (with nothing left allocated) if the pool cannot be made or an address cannot be bound.
    """
    config.validate()
    try:
        pool = create_pool(config.layout, backend=config.backend, **config.pool_size_kwargs())
    except Exception as exc:
        raise StartupError(f"cannot create the {config.backend} pool: {exc}") from exc
    try:
        try:
            manager = KVCacheManager(
                pool.num_blocks, config.block_size, max_seq_len=config.max_seq_len, max_num_seqs=config.max_num_seqs
            )
        except KVPoolError as exc:
            raise StartupError(f"bad pool configuration: {exc}") from exc
        servicer = KVPoolServicer(
            manager, pool, max_batch=config.max_batch, max_message_bytes=config.max_message_bytes
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="kvpool-rpc"),
            options=grpc_options(config),
        )
        kvpool_pb2_grpc.add_KVPoolServiceServicer_to_server(servicer, server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server,
        )
        port = _bind(server, config)
        server.start()
    except BaseException:
        pool.close()
        raise
    for service in ("", SERVICE_NAME):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    if config.port_file and port is not None:
        _write_atomically(config.port_file, f"{port}\n")
    return ServerHandle(server, port, pool, servicer, health_servicer)


def _bind(server: grpc.Server, config: ServerConfig) -> int | None:
    port = None
    if config.address:
        port = _add_port(server, config.address)
    if config.unix_socket:
        _check_unix_socket_free(config.unix_socket)
        _add_port(server, f"unix:{config.unix_socket}")
    return port


def _add_port(server: grpc.Server, address: str) -> int:
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as exc:  # grpcio raises when the bind fails
        raise StartupError(f"cannot listen on {address}: {exc} (address in use? another kvpool-server?)") from exc
    if port == 0 and not address.startswith("unix:"):
        raise StartupError(f"cannot listen on {address} (address in use? another kvpool-server?)")
    return port


def _check_unix_socket_free(path: str) -> None:
    """gRPC unlinks an existing socket file before binding; refuse instead if a server still answers there."""
    if not os.path.exists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        return  # a stale file: gRPC replaces it
    finally:
        probe.close()
    raise StartupError(f"cannot listen on unix:{path}: another server is listening there")


def _write_atomically(path: str, text: str) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".port-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def pin_threads(cpus: frozenset[int]) -> None:
    """Restrict every thread of this process (those grpc started at import included) to ``cpus``; threads started
    later inherit the mask from the thread that starts them. Repeats until a pass finds no thread it had not seen,
    since a thread not yet pinned may start another one meanwhile."""
    os.sched_setaffinity(0, cpus)
    pinned: set[int] = set()
    for _ in range(10):
        try:
            thread_ids = {int(tid) for tid in os.listdir("/proc/self/task")}
        except OSError:
            return
        if thread_ids <= pinned:
            return
        for tid in thread_ids - pinned:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread has ended
                pass
        pinned |= thread_ids


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive after start-up (modules, generated protobuf code, the pool, the
    manager's arrays) into the garbage collector's permanent generation, so that collections while serving scan
    only what calls allocate: shorter GC pauses in the latency tail. vLLM does the same after start-up. Returns the
    number of objects frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serve(config: ServerConfig) -> int:
    """Run until SIGTERM or SIGINT, then shut down gracefully. Returns the exit code."""
    cpus = config.cpu_set()
    if cpus is not None:
        pin_threads(cpus)  # before create_server: the threads it starts inherit the mask
    handle = create_server(config)
    num_frozen = freeze_startup_heap()
    stop = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    where = []
    if config.address:
        where.append(f"{config.address.rsplit(':', 1)[0]}:{handle.port}")
    if config.unix_socket:
        where.append(f"unix:{config.unix_socket}")
    logger.info(
        "kvpool-server %d listening on %s: %s pool, %d blocks of %d tokens (%d bytes each); %d start-up objects "
        "frozen out of garbage collection; CPUs %s",
        os.getpid(), ", ".join(where), handle.pool.backend, handle.pool.num_blocks, config.block_size,
        config.layout.block_bytes, num_frozen, ",".join(map(str, sorted(cpus))) if cpus else "any",
    )
    # Wake every second: a signal delivered to another thread sets Python's flag but does not interrupt this wait,
    # and the handler only runs once the main thread runs Python code again (a pinned server sometimes ignored
    # SIGTERM while this waited an hour at a time).
    while not stop.wait(1.0):
        pass
    logger.info("signal %d: shutting down (grace %.1fs)", received[0], config.shutdown_grace_s)
    shutdown(handle, config.shutdown_grace_s, config.shutdown_drain_s)
    logger.info("kvpool-server %d stopped", os.getpid())
    return 0


def shutdown(handle: ServerHandle, grace_s: float, drain_s: float = 0.0) -> None:
    """Stop serving without cutting off a call:

    1. health goes NOT_SERVING, and the servicer refuses new calls with UNAVAILABLE (calls already inside go on;
       an AppendTokenStream finishes its message in progress, then ends with UNAVAILABLE);
    2. that lasts until no call has been refused for DRAIN_QUIET_S, or ``drain_s`` at most: it empties gRPC's
       queue of calls received but not yet started, which ``server.stop`` would end with CANCELLED, not
       UNAVAILABLE (grpc/grpc#41785);
    3. the calls still inside get up to ``grace_s`` to finish;
    4. ``server.stop(0)``: the listener closes and what is left -- health Watch streams, AppendTokenStreams idle
       between messages, calls past the grace -- is cancelled (waiting on them would make every shutdown last
       ``grace_s``);
    5. the pool is released.
    """
    handle.health.enter_graceful_shutdown()
    servicer = handle.servicer
    servicer.draining = True
    now = started = time.monotonic()
    servicer.last_refused_at = started
    while now - started < drain_s and now - servicer.last_refused_at < DRAIN_QUIET_S:
        time.sleep(DRAIN_QUIET_S / 4)
        now = time.monotonic()
    grace_end = time.monotonic() + grace_s
    while servicer.num_in_flight and time.monotonic() < grace_end:
        time.sleep(0.01)
    if servicer.num_in_flight:
        logger.warning("%d calls still running after the %.1fs grace; cancelling them", servicer.num_in_flight, grace_s)
    handle.server.stop(0).wait()
    with servicer.lock:  # a call cut off at the grace deadline may still be running
        handle.pool.close()


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = load_config(argv)
    except ConfigError as exc:
        print(f"kvpool-server: {exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging(config)
    try:
        code = serve(config)
    except StartupError as exc:
        print(f"kvpool-server: {exc}", file=sys.stderr)
        sys.exit(1)
    sys.exit(code)


if __name__ == "__main__":
    main()
