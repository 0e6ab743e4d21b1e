"""Who may open and connect a fast-path channel: a local gRPC peer (OpenFastPath), then a connection from this
user's processes that sends the channel's token first.

The serving thread never waits on a peer that has not spoken (``Handshakes``): a new connection is accepted
non-blocking, its peer's uid checked at once (``SO_PEERCRED``), and its token read as its bytes come -- at once
for the real client, which sends it with the connect; a silent or slow peer only waits in the table, beside the
channels, until it has sent its 16 bytes, goes away, or passes ``HANDSHAKE_TIMEOUT_S``. The table holds at most
``MAX_HANDSHAKES`` connections: one more closes the oldest (a peer that has not spoken keeps nothing but its fd).
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import struct
import time

logger = logging.getLogger(__name__)
TOKEN_BYTES = 16
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not sent its whole token within this is closed
MAX_HANDSHAKES = 64  # connections waiting for their token at once; one more closes the oldest


def is_local_peer(peer: str | None) -> bool:
    """gRPC's peer string of a unix socket or loopback client."""
    if not peer:
        return False
    return peer.startswith("unix:") or peer.startswith("ipv4:127.") or peer.startswith("ipv6:[::1]")


def new_token() -> bytes:
    return os.urandom(TOKEN_BYTES)


def same_user(sock: socket.socket) -> bool:
    """The peer's uid (``SO_PEERCRED``) is ours: only this user's processes may map the segment (mode 0600)."""
    try:
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
    except OSError:
        return False
    return uid == os.getuid()


class Handshake:
    __slots__ = ("sock", "fd", "received", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.received = b""
        self.deadline = deadline


class Handshakes:
    """Accepted connections that have not sent their whole token yet, by fd, each registered in the serving
    thread's ``selector`` (with itself as the key's data) -- the serving thread's alone. Invariant: at most
    ``limit`` entries; each one's socket is open, non-blocking, of this user's, registered, and has sent fewer
    than TOKEN_BYTES bytes."""

    def __init__(self, selector: selectors.BaseSelector, limit: int = MAX_HANDSHAKES,
                 timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.selector = selector
        self.limit = limit
        self.timeout_s = timeout_s
        self.waiting: dict[int, Handshake] = {}  # insertion order: the oldest first
        self.closed = 0  # connections closed without a token (silent, slow, of another user, evicted)

    def __len__(self) -> int:
        return len(self.waiting)

    def accept(self, listener: socket.socket, most: int) -> list[tuple[socket.socket, bytes]]:
        """Accept up to ``most`` new connections from the (non-blocking) listener; returns those whose token had
        already come, with it (theirs to bind); the others wait in the table."""
        ready = []
        for _ in range(most):
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # out of fds, say: the connection stays queued; the next look tries again
                logger.warning("fast path: accept failed", exc_info=True)
                break
            token = self.start(sock)
            if token is not None:
                ready.append((sock, token))
        return ready

    def start(self, sock: socket.socket) -> bytes | None:
        """A just-accepted connection: its token when it is already there (the socket is the caller's), else None
        (it waits in the table, or was refused and closed). A full table closes its oldest first."""
        if not same_user(sock):
            self._closed(sock)
            return None
        sock.setblocking(False)
        shake = Handshake(sock, time.monotonic() + self.timeout_s)
        token = self._read(shake)
        if token is not None or shake.sock.fileno() < 0:
            return token
        while len(self.waiting) >= self.limit:
            self._drop(next(iter(self.waiting.values())))
        self.waiting[shake.fd] = shake
        self.selector.register(sock, selectors.EVENT_READ, shake)
        return None

    def readable(self, shake: Handshake) -> bytes | None:
        """Bytes came (or the end): the token once complete (the handshake leaves the table; its socket is the
        caller's, unregistered), else None (still waiting, or gone)."""
        token = self._read(shake)
        if token is not None:
            self.waiting.pop(shake.fd, None)
            self.selector.unregister(shake.sock)
        elif shake.sock.fileno() < 0:  # closed by _read: the peer went away
            self.waiting.pop(shake.fd, None)
        return token

    def expire(self, now: float) -> None:
        """Close the handshakes past their deadline."""
        for shake in [s for s in self.waiting.values() if s.deadline <= now]:
            self._drop(shake)

    def close_all(self) -> None:
        for shake in list(self.waiting.values()):
            self._drop(shake)

    def check_invariants(self) -> None:
        assert len(self.waiting) <= self.limit
        for fd, shake in self.waiting.items():
            assert shake.fd == fd == shake.sock.fileno() and len(shake.received) < TOKEN_BYTES
            assert self.selector.get_key(shake.sock).data is shake

    def _drop(self, shake: Handshake) -> None:
        self.waiting.pop(shake.fd, None)
        if shake.sock.fileno() >= 0:
            self.selector.unregister(shake.sock)
        self._closed(shake.sock)

    def _read(self, shake: Handshake) -> bytes | None:
        """The token once all its bytes came; None (not yet, or the peer went away: then closed)."""
        try:
            chunk = shake.sock.recv(TOKEN_BYTES - len(shake.received))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            chunk = b""
        if not chunk:  # the peer went away before its token
            if shake.fd in self.waiting:
                self.selector.unregister(shake.sock)
            self._closed(shake.sock)
            return None
        shake.received += chunk
        return shake.received if len(shake.received) == TOKEN_BYTES else None

    def _closed(self, sock: socket.socket) -> None:
        if sock.fileno() >= 0:
            self.closed += 1
        sock.close()
