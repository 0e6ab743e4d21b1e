"""ChannelRegistry: the fast path's channels by state -- pending (opened, by token) or live (connected, by fd).

OpenFastPath adds a pending channel on the event loop; the serving thread binds it to its connection, and removes
it when it ends. Everything else about a channel is the serving thread's (``FastPathServer``).
"""

from __future__ import annotations

import socket
import threading

from kvpool import fastpath as fp
from kvpool_server.core.sessions import SessionTable
from kvpool_server.fastpath.channel import Channel
from kvpool_server.service.errors import TooManyStreamsError


class ChannelRegistry:
    """Invariants (``check_invariants``): a channel is pending (by its token, not yet connected, its segment's
    name still linked) or live (by its socket's fd, connected, its name unlinked), never both; every one is
    mapped; no more than ``max_channels`` in all; between records, a live channel's ``last_seq`` is what its
    segment's ``CTL_REP_SEQ`` says (the server's own count, published with every reply), and a channel with a
    record settling on the loop (``deferred``) waits for it: seq ``last_seq + 1``."""

    def __init__(self, max_channels: int) -> None:
        self.max_channels = max_channels
        self.lock = threading.Lock()  # open() runs on the event loop, the rest on the serving thread
        self.pending: dict[bytes, Channel] = {}  # by token, until the client connects
        self.channels: dict[int, Channel] = {}  # by socket fd

    def check_room(self) -> None:
        """Under ``lock``: RESOURCE_EXHAUSTED when ``max_channels`` are open (pending ones count)."""
        if len(self.pending) + len(self.channels) >= self.max_channels:
            raise TooManyStreamsError(f"--fast-path-max-channels={self.max_channels} channels are open: use gRPC")

    def bind(self, token: bytes, sock: socket.socket) -> Channel | None:
        """The pending channel of ``token``, now live on ``sock``; None: no such channel (or a fenced one,
        closed here); the caller closes ``sock`` then."""
        with self.lock:
            channel = self.pending.pop(token, None)
            if channel is not None and not channel.fenced:
                channel.connected(sock)
                self.channels[sock.fileno()] = channel
                return channel
        if channel is not None:
            channel.close()
        return None

    def remove(self, channel: Channel) -> None:
        """Take ``channel`` out, pending or live (before its socket closes)."""
        with self.lock:
            if channel.sock is not None:
                self.channels.pop(channel.sock.fileno(), None)
            self.pending.pop(channel.token, None)

    def ended(self, live_sessions: SessionTable) -> list[Channel]:
        """The channels, pending or live, whose session is not in ``live_sessions`` (the session table)."""
        with self.lock:
            return [c for c in (*self.channels.values(), *self.pending.values())
                    if c.session_id not in live_sessions]

    def stale(self, now: float, connect_timeout_s: float) -> list[Channel]:
        """The pending channels opened more than ``connect_timeout_s`` before ``now``."""
        with self.lock:
            return [c for c in self.pending.values() if now - c.opened_at > connect_timeout_s]

    def close_all(self) -> None:
        with self.lock:
            for channel in (*self.channels.values(), *self.pending.values()):
                channel.close()
            self.channels.clear()
            self.pending.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError when the class docstring's invariants do not hold (tests; read under the lock)."""
        with self.lock:
            assert len(self.pending) + len(self.channels) <= self.max_channels
            assert not {id(c) for c in self.pending.values()} & {id(c) for c in self.channels.values()}
            for token, channel in self.pending.items():
                assert channel.token == token and channel.sock is None and channel.linked and channel.views
            for fd, channel in self.channels.items():
                assert channel.sock is not None and channel.sock.fileno() == fd and not channel.linked
                assert channel.views is not None or channel.fenced
                if channel.views is not None and not channel.fenced:
                    assert int(channel.views.ctl[fp.CTL_REP_SEQ]) == channel.last_seq
                    assert channel.deferred is None or channel.deferred[0] == channel.last_seq + 1

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {"channels": len(self.channels), "pending": len(self.pending),
                    "deferred": sum(c.deferred is not None for c in self.channels.values())}
