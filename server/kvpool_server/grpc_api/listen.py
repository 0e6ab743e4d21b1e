"""Where the server listens and how the transport is protected: TLS / mutual TLS on TCP, the unix socket's mode.

    --address HOST:PORT        TCP. A non-loopback HOST needs --auth-tokens or --tls-cert, or an explicit
                               --insecure (logged as a warning): no one binds the pool to a network by accident.
    --tls-cert/--tls-key       TLS on the TCP address (PEM files); --tls-client-ca CA.pem: mutual TLS, a client
                               must present a certificate that CA signed (another CA's is refused in the handshake).
    --unix-socket PATH         created mode 0600 (the server's uid only); --unix-socket-group G: 0660, group G.
                               The unix socket is never TLS: its file mode is its access control.
    --metrics-address HOST:PORT  Prometheus metrics, with no authentication: a non-loopback HOST needs --insecure.
"""

from __future__ import annotations

import grp
import os
import socket
from typing import TYPE_CHECKING

import grpc

from kvpool_server.grpc_api.bind_errors import why_bind_failed

if TYPE_CHECKING:
    from kvpool_server.config import ServerConfig


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    with open(config.tls_key, "rb") as f:  # type: ignore[arg-type]
        key = f.read()
    with open(config.tls_cert, "rb") as f:
        cert = f.read()
    client_ca = None
    if config.tls_client_ca:
        with open(config.tls_client_ca, "rb") as f:
            client_ca = f.read()
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def bind(server: grpc.aio.Server, config: ServerConfig, startup_error: type[Exception]) -> int | None:
    port = None
    if config.address:
        port = _add_port(server, config.address, server_credentials(config), startup_error)
    if config.unix_socket:
        _check_unix_socket_free(config.unix_socket, startup_error)
        old = os.umask(0o177)  # the socket file is born 0600: no window in which others may connect
        try:
            _add_port(server, f"unix:{config.unix_socket}", None, startup_error)
        finally:
            os.umask(old)
        _set_socket_access(config.unix_socket, config.unix_socket_group, startup_error)
    return port


def _set_socket_access(path: str, group: str, startup_error: type[Exception]) -> None:
    if not group:
        os.chmod(path, 0o600)
        return
    try:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    except (KeyError, PermissionError) as exc:
        raise startup_error(f"--unix-socket-group {group}: {exc}") from exc
    os.chmod(path, 0o660)


def _add_port(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None,
              startup_error: type[Exception]) -> int:
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:  # grpcio raises when the bind fails; its message names no cause
        raise startup_error(f"cannot listen on {address}: {why_bind_failed(address)}") from exc
    if port == 0 and not address.startswith("unix:"):
        raise startup_error(f"cannot listen on {address}: {why_bind_failed(address)}")
    return port


def _check_unix_socket_free(path: str, startup_error: type[Exception]) -> None:
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
    raise startup_error(f"cannot listen on unix:{path}: another server is listening there")
