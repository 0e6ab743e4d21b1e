"""build_server(config): the pool, the core, the servicer and the gRPC server around them (KVPoolService, health,
reflection), bound to its addresses but not started -- ``ServerHandle.start()`` does that (main.serve, tests,
benchmarks). ``build_servicer(config)`` is the part without gRPC's server, for hosts of another kind (grpc.aio in
benchmarks/bench_service_servers.py).
"""

from __future__ import annotations

import os
import socket
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvpool.v1 import kvpool_pb2, kvpool_pb2_grpc
from kvpool_server.config import ServerConfig
from kvpool_server.core import KVCacheManager, KVPoolError
from kvpool_server.core.sessions import SessionTable, new_server_epoch
from kvpool_server.device import create_pool
from kvpool_server.drain import Drain
from kvpool_server.pool_protocol import Pool
from kvpool_server.reaper import Reaper
from kvpool_server.service import KVPoolServicer

SERVICE_NAME = kvpool_pb2.DESCRIPTOR.services_by_name["KVPoolService"].full_name


class StartupError(RuntimeError):
    """The server cannot start (address in use, no GPU, ...); the message says why."""


@dataclass(frozen=True)
class ServerHandle:
    server: grpc.Server
    port: int | None  # the bound TCP port (None when only a unix socket is used)
    pool: Pool
    servicer: KVPoolServicer
    drain: Drain  # the servicer's: shutdown starts it
    health: health.HealthServicer
    reaper: Reaper  # ends sessions whose lease passed; shutdown stops it

    def start(self) -> None:
        """Start serving; health says SERVING (for "" and KVPoolService) from now on."""
        self.server.start()
        self.reaper.start()
        for service in ("", SERVICE_NAME):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)


def grpc_options(config: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.so_reuseport", 0),  # a second server on the same port must fail, not share it
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]


def build_servicer(config: ServerConfig) -> KVPoolServicer:
    """Allocate the pool and make the core and the servicer over it. Raises StartupError, with nothing left
    allocated, if the pool cannot be made or the configuration does not fit it."""
    config.validate()
    try:
        pool = create_pool(config.layout, backend=config.backend, **config.pool_size_kwargs())
    except Exception as exc:
        raise StartupError(f"cannot create the {config.backend} pool: {exc}") from exc
    try:
        manager = KVCacheManager(
            pool.num_blocks, config.block_size, max_seq_len=config.max_seq_len, max_num_seqs=config.max_num_seqs
        )
    except KVPoolError as exc:
        pool.close()
        raise StartupError(f"bad pool configuration: {exc}") from exc
    sessions = SessionTable(
        new_server_epoch(),
        default_ttl_s=config.session_ttl_ms / 1000.0,
        max_ttl_s=config.max_session_ttl_ms / 1000.0,
    )
    return KVPoolServicer(
        manager, pool, Drain(), sessions, max_batch=config.max_batch, max_message_bytes=config.max_message_bytes
    )


def build_server(config: ServerConfig) -> ServerHandle:
    """``build_servicer`` plus the gRPC server (KVPoolService, health, reflection), bound to ``config``'s
    addresses, not started. Raises StartupError (with nothing left allocated) if an address cannot be bound."""
    servicer = build_servicer(config)
    try:
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
    except BaseException:
        servicer.pool.close()
        raise
    return ServerHandle(
        server, port, servicer.pool, servicer, servicer.drain, health_servicer, Reaper(servicer.reap_expired)
    )


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
