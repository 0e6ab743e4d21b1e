"""FastPathServer: the shared-memory channels of local sessions, served by one thread ("kvpool-fastpath").

    OpenFastPath (gRPC, on the event loop)  -> open(): a Channel (segment created, name + token answered)
    the client maps the segment, connects to the abstract unix socket, sends the token -> the channel is live
    the thread: serve every channel whose CTL_REQ_SEQ moved; spin SPIN_S (releasing the GIL each round) for the
                next one; then mark every channel "server parked" and wait in epoll for a wake byte, a new
                connection, a control note or PARK_TIMEOUT_S
    a session's end (closed, lease expired, keep-alive broken) -> its records are refused by the session table at
                once (CoreGuard.mutate: the same fencing as gRPC); within REAP_INTERVAL_S the thread fences its
                channels (the flag in the segment) and closes them
    the client's socket closes (it exited or died) -> the channel is closed (its session ends by its keep-alive)
    stop() (server shutdown) -> every channel fenced and closed; parked clients woken (they see the fence)

Every record is served through ``scope.call`` and the same ``KVPoolService`` methods as gRPC (records.py): the
thread takes the core's lock like any call, so the event loop (health checks, streams) keeps running; the thread
gives the GIL and the core up after every record and at every look of its spin (``os.sched_yield()``), so the loop
waits at most one record's work, not Python's 5 ms GIL switch interval.

Bounds: at most ``max_channels`` channels of ``2 * area_bytes + 256`` bytes of shared memory each; a channel
opened but never connected is closed after CONNECT_TIMEOUT_S.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import threading
import time
from typing import Any

from kvpool import fastpath as fp
from kvpool_server.core import InvalidArgumentError
from kvpool_server.core.errors import FailedPreconditionError
from kvpool_server.fastpath.channel import Channel, memory_barrier, new_name
from kvpool_server.fastpath.fair_channels import FairChannels
from kvpool_server.fastpath.handshake import is_local_peer, new_token, read_token
from kvpool_server.fastpath.records import ChannelHeaders, serve_record
from kvpool_server.service.errors import TooManyStreamsError
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import Call, CallScope

logger = logging.getLogger(__name__)
SPIN_S = 50e-6  # after the last record, look for the next one this long before parking
PARK_TIMEOUT_S = 0.1  # a parked thread looks anyway this often (a wake lost to store/load reordering costs this)
REAP_INTERVAL_S = 0.1  # how often the channels of ended sessions are looked for (the sessions' reaper's period)
CONNECT_TIMEOUT_S = 10.0
POLL_BUSY_S = 0.01  # a busy thread (never parked) still takes new connections and dead clients' EOFs this often


class FastPathServer:
    """The channels and their thread. Invariants (``check_invariants``): a channel is pending (by its token, not
    yet connected, its segment's name still linked) or live (by its socket's fd, connected, its name unlinked),
    never both; every one is mapped; no more than ``max_channels`` in all; between records, a live channel's
    ``last_seq`` is what its segment's ``CTL_REP_SEQ`` says (the server's own count, published with every reply)."""

    def __init__(self, service: KVPoolService, scope: CallScope, *, area_bytes: int, max_channels: int) -> None:
        self.service = service
        self.scope = scope
        self.area_bytes = area_bytes
        self.max_channels = max_channels
        self.lock = threading.Lock()  # the registry: open() runs on the event loop, the rest on the thread
        self.pending: dict[bytes, Channel] = {}  # by token, until the client connects
        self.channels: dict[int, Channel] = {}  # by socket fd
        self.reaped_at = 0.0  # when the thread last closed the channels of ended sessions
        self.polled_at = 0.0  # when the busy thread last looked at its sockets
        self.address = f"kvpool-fastpath-{os.getpid()}-{os.urandom(6).hex()}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + self.address)
        self.listener.listen(64)
        self.listener.setblocking(False)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "note")
        self.running = True
        self.thread = threading.Thread(target=self._run, name="kvpool-fastpath", daemon=True)
        self.served = 0
        self.fair = FairChannels(service, self._note)  # the sessions' fair share of this thread (fair_channels.py)

    def start(self) -> None:
        self.thread.start()

    # ---------------------------------------------------------------- from the event loop
    def open(self, call: Call, session_id: int, peer: str | None) -> tuple[Channel, str]:
        """OpenFastPath: a channel for the caller's live session; returns it and the socket address."""
        if not self.running:
            raise FailedPreconditionError("the fast path is stopping: use gRPC")
        if not is_local_peer(peer):
            raise FailedPreconditionError(f"the fast path is for clients on the server's host; {peer} is not: use gRPC")
        if not session_id:
            raise InvalidArgumentError("OpenFastPath needs a session_id (a channel lives as long as its session)")
        guard = self.service.guard
        with guard.lock:
            guard.fence(call.caller, session_id)  # live, the caller's tenant's (NOT_FOUND otherwise); renewed
            with self.lock:
                if len(self.pending) + len(self.channels) >= self.max_channels:
                    raise TooManyStreamsError(
                        f"--fast-path-max-channels={self.max_channels} channels are open: use gRPC")
                token = new_token()
                generation = int.from_bytes(os.urandom(7), "little") or 1
                try:
                    channel = Channel(new_name(), self.area_bytes, session_id, call.caller,
                                      call.headers.get("authorization"), generation, token)
                except OSError as exc:  # /dev/shm full, say: the client goes on over gRPC
                    raise FailedPreconditionError(f"cannot make a fast-path segment ({exc}): use gRPC") from None
                channel.opened_at = time.monotonic()
                self.pending[token] = channel
        return channel, "@" + self.address

    def stop(self) -> None:
        """Fence and close every channel, stop the thread (idempotent)."""
        if not self.running:
            return
        self.running = False
        self._note()
        if self.thread.is_alive():
            self.thread.join(5)
        with self.lock:
            for channel in (*self.channels.values(), *self.pending.values()):
                channel.close()
            self.channels.clear()
            self.pending.clear()
        self.fair.close()  # before the wake pipe closes: the hasher never writes to its fd after
        self.selector.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _note(self) -> None:
        try:
            os.write(self.wake_w, b"n")
        except BlockingIOError:
            pass  # a note is already waiting

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        idle_since = time.perf_counter()
        while self.running:
            try:
                if self._serve_ready():  # it yields the GIL and the core after every record
                    idle_since = time.perf_counter()
                    self._poll_events()
                    self._reap_ended()
                    continue
                if time.perf_counter() - idle_since < SPIN_S:
                    os.sched_yield()  # releases the GIL and the core: the event loop runs between our looks
                    continue
                self._park()
                idle_since = time.perf_counter()
            except Exception:  # a bug here must not end the thread: every channel would hang
                logger.exception("fast path: serving failed")
                time.sleep(0.01)

    def _poll_events(self) -> None:
        """While busy: new connections, clients that went away (the parked thread gets these from ``select``)."""
        now = time.monotonic()
        if now - self.polled_at >= POLL_BUSY_S:
            self.polled_at = now
            for key, _ in self.selector.select(0):
                self._event(key.data, key.fileobj)

    def _reap_ended(self) -> None:
        """Fence and close the channels whose session has ended (closed, lease expired, keep-alive broken): every
        REAP_INTERVAL_S, busy or parked. Their records were refused by the session table already (``guard``)."""
        now = time.monotonic()
        if now - self.reaped_at < REAP_INTERVAL_S:
            return
        self.reaped_at = now
        live = self.service.guard.sessions
        for channel in [c for c in (*self.channels.values(), *self.pending.values()) if c.session_id not in live]:
            channel.fence(fp.FENCED_SESSION_ENDED)
            self._close(channel)

    def _serve_ready(self) -> bool:
        served = False
        for channel in self.fair.order(list(self.channels.values())):
            views = channel.views
            if views is None or channel.fenced:
                continue
            seq = int(views.ctl[fp.CTL_REQ_SEQ])
            if seq == channel.last_seq:
                continue
            if seq != channel.last_seq + 1:  # only the client writes it, so it broke the protocol
                logger.warning("fast path: session %d wrote request seq %d after %d: channel closed",
                               channel.session_id, seq, channel.last_seq)
                channel.fence(fp.FENCED_PROTOCOL)
                self._close(channel)
                continue
            if self.fair.defer(channel, views, seq):  # its prompt is hashed off this thread: the others first
                continue
            started = time.perf_counter()
            serve_record(self.service, self.scope, views, ChannelHeaders(channel.authorization), channel.session_id,
                         channel.generation, seq, self.fair.take(channel))
            self.fair.charge(channel, time.perf_counter() - started)
            channel.last_seq = seq
            self.served += 1
            memory_barrier()
            channel.wake_client()
            served = True
            os.sched_yield()  # after every record: the event loop waits for one record at most, not a round
        return served

    def _park(self) -> None:
        channels = list(self.channels.values())
        for channel in channels:
            if channel.views is not None:
                channel.views.ctl[fp.CTL_SERVER_PARKED] = 1
        memory_barrier()
        if not self._serve_ready():  # a request published before our flag was visible
            timeout = PARK_TIMEOUT_S if channels or self.pending else None
            for key, _ in self.selector.select(timeout):
                self._event(key.data, key.fileobj)
        for channel in channels:
            if channel.views is not None:
                channel.views.ctl[fp.CTL_SERVER_PARKED] = 0
        self._reap_ended()
        self._expire_pending()

    def _event(self, kind: Any, fileobj: Any) -> None:
        if kind == "listen":
            self._accept()
        elif kind == "note":  # stop(): the loop's condition says it
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                pass
        else:
            channel: Channel = kind
            try:
                data = channel.sock.recv(4096) if channel.sock is not None else b""
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:  # the client closed its end (close(), exit, death)
                self._close(channel)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        token = read_token(sock)
        if token is None:
            return
        with self.lock:
            channel = self.pending.pop(token, None)
            if channel is not None and not channel.fenced:
                channel.connected(sock)
                self.channels[sock.fileno()] = channel
        if channel is None or channel.fenced:
            sock.close()
            if channel is not None:
                channel.close()
            return
        sock.setblocking(False)
        try:
            sock.send(b"k")  # bound: the client may send records
        except OSError:
            self._close(channel)
            return
        self.selector.register(sock, selectors.EVENT_READ, channel)

    def _close(self, channel: Channel) -> None:
        with self.lock:
            if channel.sock is not None:
                self.channels.pop(channel.sock.fileno(), None)
                try:
                    self.selector.unregister(channel.sock)
                except (KeyError, ValueError):
                    pass
            self.pending.pop(channel.token, None)
            self.fair.forget(channel)
            channel.close()

    def _expire_pending(self) -> None:
        if not self.pending:
            return
        now = time.monotonic()
        with self.lock:
            stale = [c for c in self.pending.values() if now - c.opened_at > CONNECT_TIMEOUT_S]
        for channel in stale:
            self._close(channel)

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
            self.fair.check_invariants(list(self.channels.values()))

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"channels": len(self.channels), "pending": len(self.pending), "served": self.served}
