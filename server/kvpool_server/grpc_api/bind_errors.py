"""Why gRPC could not bind an address: gRPC says only "Failed to bind", so the bind is tried again with a plain
socket, whose errno names the cause (a port in use, an address not of this host, a port that needs privileges, a
missing directory, a socket path too long), and the message says what to do. Called only after gRPC failed."""

from __future__ import annotations

import errno
import os
import socket

MAX_UNIX_PATH_BYTES = 107  # sun_path is 108 bytes with its NUL


def why_bind_failed(address: str) -> str:
    """The cause of a failed bind of ``address`` (HOST:PORT, [V6]:PORT or unix:PATH), as a sentence."""
    if address.startswith("unix:"):
        return _unix(address.removeprefix("unix:"))
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host or None, int(port_text), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError) as exc:
        return f"cannot resolve {host!r} to an address of this host ({exc})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does: TIME_WAIT is no conflict
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return _tcp(exc, host, port_text)
    return "gRPC could not bind it, though a plain socket can (was the port taken and released meanwhile?)"


def _tcp(exc: OSError, host: str, port: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} is in use on {host or 'this host'} (another kvpool-server? `ss -ltnp 'sport = :{port}'` "
                "names the process): stop it, or choose another --address")
    if exc.errno == errno.EADDRNOTAVAIL:
        return (f"{host} is not an address of this host: give one of its interfaces' addresses, or 0.0.0.0 for "
                "all of them (which needs --auth-tokens, --tls-cert or --insecure)")
    if exc.errno == errno.EACCES:
        return f"port {port} needs privileges (ports below 1024 do): choose a port >= 1024"
    return f"{exc.strerror} (errno {errno.errorcode.get(exc.errno or 0, exc.errno)})"


def _unix(path: str) -> str:
    if len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
        return (f"the socket path is {len(os.fsencode(path))} bytes long; a unix socket's path is at most "
                f"{MAX_UNIX_PATH_BYTES}: choose a shorter one")
    directory = os.path.dirname(path) or "."
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        return f"the directory {directory} {what}: create it (mkdir -p {directory}) or choose another --unix-socket"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"no permission to create a file in {directory} (this process runs as uid {os.getuid()})"
    if os.path.isdir(path):
        return f"{path} is a directory: give the socket file's path, e.g. {os.path.join(path, 'kvpool.sock')}"
    return "gRPC could not bind it (see the gRPC error above)"
