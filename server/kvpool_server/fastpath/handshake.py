"""Who may open and connect a fast-path channel: a local gRPC peer (OpenFastPath), then a connection from this
user's processes that sends the channel's token first."""

from __future__ import annotations

import os
import socket
import struct

TOKEN_BYTES = 16
HANDSHAKE_TIMEOUT_S = 0.05  # the most a connection that does not send its token holds the serving thread up


def is_local_peer(peer: str | None) -> bool:
    """gRPC's peer string of a unix socket or loopback client."""
    if not peer:
        return False
    return peer.startswith("unix:") or peer.startswith("ipv4:127.") or peer.startswith("ipv6:[::1]")


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)


def read_token(sock: socket.socket) -> bytes | None:
    """The token a new connection sends first, or None (and the socket closed): a peer of another uid (only this
    user's processes may map the segment, mode 0600, anyway), or no token within HANDSHAKE_TIMEOUT_S (the client
    sends it with the connect: it is there)."""
    try:
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid == os.getuid():
            sock.settimeout(HANDSHAKE_TIMEOUT_S)
            token = b""
            while len(token) < TOKEN_BYTES:
                chunk = sock.recv(TOKEN_BYTES - len(token))
                if not chunk:
                    break
                token += chunk
            if len(token) == TOKEN_BYTES:
                return token
    except OSError:
        pass
    sock.close()
    return None
