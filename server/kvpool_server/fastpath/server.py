"""FastPathServer: the shared-memory channels of local sessions, served by one thread ("kvpool-fastpath").

    OpenFastPath (gRPC, on the event loop)  -> open(): a Channel (segment created, name + token answered); the
                thread is woken (it now parks with a timeout: the pending channel expires)
    the client maps the segment, connects to the abstract unix socket, sends the token -> the channel is live
                (the thread never waits on a peer that has not spoken: ``handshake.Handshakes``)
    the thread: serve every channel whose CTL_REQ_SEQ moved; spin SPIN_S (releasing the GIL each round) for the
                next one; then mark every channel "server parked" and wait in epoll for a wake byte, a new
                connection, a control note or PARK_TIMEOUT_S
    a record whose answer is an Offload or a Wait (``records.Deferred``) -> settled on the event loop (the same
                adapter as gRPC's); the thread goes on with the other channels and writes that reply once it
                has settled (a note wakes it)
    a session's end (closed, lease expired, keep-alive broken) -> its records are refused by the session table at
                once (CoreGuard.mutate: the same fencing as gRPC); within REAP_INTERVAL_S the thread fences its
                channels (the flag in the segment) and closes them, pending ones too (their names unlinked)
    the client's socket closes (it exited or died) -> the channel is closed (its session ends by its keep-alive)
    stop() (server shutdown) -> every channel fenced and closed; parked clients woken (they see the fence)

Every record is served through ``scope.call`` and the same ``KVPoolService`` methods as gRPC (records.py): the
thread takes the core's lock like any call, so the event loop (health checks, streams) keeps running; the thread
gives the GIL and the core up after every record and at every look of its spin (``os.sched_yield()``), so the loop
waits at most one record's work, not Python's 5 ms GIL switch interval. A record is answered once, whatever fails
after it is applied: a reply that cannot be written is an INTERNAL reply, and the record is never served again.

Bounds: at most ``max_channels`` channels of ``2 * area_bytes + 256`` bytes of shared memory each; a channel
opened but never connected is closed after CONNECT_TIMEOUT_S (or with its session); at most MAX_HANDSHAKES
connections waiting for their token, each for HANDSHAKE_TIMEOUT_S at most.
"""

from __future__ import annotations

import asyncio
import logging
import os
import selectors
import socket
import threading
import time
from concurrent.futures import Executor
from typing import Any

from kvpool import fastpath as fp
from kvpool_server.core import InvalidArgumentError
from kvpool_server.core.errors import FailedPreconditionError
from kvpool_server.fastpath.channel import Channel, memory_barrier, new_name
from kvpool_server.fastpath.fair_channels import FairChannels
from kvpool_server.fastpath.handshake import Handshake, Handshakes, is_local_peer, new_token
from kvpool_server.fastpath.records import serve_record, write_bug
from kvpool_server.fastpath.registry import ChannelRegistry
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import Call, CallScope

logger = logging.getLogger(__name__)
SPIN_S = 50e-6  # after the last record, look for the next one this long before parking
PARK_TIMEOUT_S = 0.1  # a parked thread looks anyway this often (a wake lost to store/load reordering costs this)
REAP_INTERVAL_S = 0.1  # how often ended sessions' channels, stale pending ones and late handshakes are closed
CONNECT_TIMEOUT_S = 10.0
POLL_BUSY_S = 0.01  # a busy thread (never parked) still takes new connections and dead clients' EOFs this often
ACCEPTS_PER_EVENT = 16  # connections accepted at one look at the listener (each costs a non-blocking recv)


class FastPathServer:
    """The channels (``registry``, whose docstring has their invariants) and their thread."""

    def __init__(self, service: KVPoolService, scope: CallScope, *, area_bytes: int, max_channels: int,
                 executor: Executor | None = None) -> None:
        self.service = service
        self.scope = scope
        self.area_bytes = area_bytes
        self.executor = executor  # Offloads' work (gRPC's copy threads); None: the loop's default executor
        self.loop: asyncio.AbstractEventLoop | None = None  # the event loop (OpenFastPath runs on it)
        self.registry = ChannelRegistry(max_channels)
        self.housekept_at = 0.0  # when the thread last closed ended, stale and late things
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
        self.handshakes = Handshakes(self.selector)
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
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        guard = self.service.guard
        with guard.lock:
            guard.fence(call.caller, session_id)  # live, the caller's tenant's (NOT_FOUND otherwise); renewed
            with self.registry.lock:
                self.registry.check_room()
                token = new_token()
                generation = int.from_bytes(os.urandom(7), "little") or 1
                try:
                    channel = Channel(new_name(), self.area_bytes, session_id, call.caller,
                                      call.headers.get("authorization"), generation, token)
                except OSError as exc:  # /dev/shm full, say: the client goes on over gRPC
                    raise FailedPreconditionError(f"cannot make a fast-path segment ({exc}): use gRPC") from None
                channel.opened_at = time.monotonic()
                self.registry.pending[token] = channel
        self._note()  # a parked thread without channels waits with no timeout: now it must expire this one
        return channel, "@" + self.address

    def stop(self) -> None:
        """Fence and close every channel, stop the thread (idempotent)."""
        if not self.running:
            return
        self.running = False
        self._note()
        if self.thread.is_alive():
            self.thread.join(5)
        self.registry.close_all()
        self.handshakes.close_all()
        self.fair.close()  # before the wake pipe closes: the hasher never writes to its fd after
        self.selector.close()
        self.listener.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _note(self) -> None:
        try:
            os.write(self.wake_w, b"n")
        except (BlockingIOError, OSError):
            pass  # a note is already waiting (or stop() closed the pipe)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        idle_since = time.perf_counter()
        while self.running:
            try:
                if self._serve_ready():  # it yields the GIL and the core after every record
                    idle_since = time.perf_counter()
                    self._poll_events()
                    self._housekeeping()
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
        """While busy: new connections, handshakes, clients that went away (the parked thread gets these from
        ``select``)."""
        now = time.monotonic()
        if now - self.polled_at >= POLL_BUSY_S:
            self.polled_at = now
            for key, _ in self.selector.select(0):
                self._event(key.data, key.fileobj)

    def _housekeeping(self) -> None:
        """Every REAP_INTERVAL_S, busy or parked: fence and close the channels whose session has ended (closed,
        lease expired, keep-alive broken; their records were refused by the session table already), pending or
        live; close the pending channels never connected within CONNECT_TIMEOUT_S, and the late handshakes."""
        now = time.monotonic()
        if now - self.housekept_at < REAP_INTERVAL_S:
            return
        self.housekept_at = now
        for channel in self.registry.ended(self.service.guard.sessions):
            channel.fence(fp.FENCED_SESSION_ENDED)
            self._close(channel)
        for channel in self.registry.stale(now, CONNECT_TIMEOUT_S):
            self._close(channel)
        self.handshakes.expire(now)

    def _serve_ready(self) -> bool:
        served = False
        for channel in self.fair.order(list(self.registry.channels.values())):
            views = channel.views
            if views is None or channel.fenced:
                continue
            if channel.deferred is not None:  # a record settling on the loop: its reply once it has
                if channel.deferred[2].done():
                    self._answer_deferred(channel, views)
                    served = True
                continue
            seq = views.ctl_words[fp.CTL_REQ_SEQ]  # a Python int (a memoryview's word: every channel, every look)
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
            try:
                deferred = serve_record(self.service, self.scope, views, channel.headers, channel.session_id,
                                        channel.generation, seq, self.fair.take(channel))
            except Exception as exc:  # a bug of ours, maybe after the record was applied: answered, never again
                logger.exception("fast path: record %d of session %d failed", seq, channel.session_id)
                self._answer_bug(channel, views, seq, exc)
                deferred = None
            elapsed = time.perf_counter() - started
            if deferred is not None:
                channel.deferred = (seq, deferred, deferred.start(self.loop, self.executor, self._note))
                self.fair.charge(channel, elapsed)
                continue
            self._answered(channel, seq)
            self.fair.charge(channel, elapsed)  # after the reply is published: not part of the client's wait
            served = True
            os.sched_yield()  # after every record: the event loop waits for one record at most, not a round
        return served

    def _answer_deferred(self, channel: Channel, views: fp.Views) -> None:
        seq, deferred, _ = channel.deferred or (0, None, None)
        channel.deferred = None
        try:
            deferred.write(views, seq)
        except Exception as exc:
            logger.exception("fast path: the reply of record %d of session %d failed", seq, channel.session_id)
            self._answer_bug(channel, views, seq, exc)
        self._answered(channel, seq)

    def _answer_bug(self, channel: Channel, views: fp.Views, seq: int, exc: Exception) -> None:
        try:
            write_bug(views, seq, exc)
        except Exception:  # not even an error reply: the channel is given up (the client sees the fence)
            channel.fence(fp.FENCED_PROTOCOL)

    def _answered(self, channel: Channel, seq: int) -> None:
        channel.last_seq = seq
        self.served += 1
        memory_barrier()
        channel.wake_client()

    def _park(self) -> None:
        channels = list(self.registry.channels.values())
        for channel in channels:
            if channel.views is not None:
                channel.views.ctl[fp.CTL_SERVER_PARKED] = 1
        memory_barrier()
        if not self._serve_ready():  # a request published before our flag was visible
            timeout = PARK_TIMEOUT_S if channels or self.registry.pending or len(self.handshakes) else None
            for key, _ in self.selector.select(timeout):
                self._event(key.data, key.fileobj)
        for channel in channels:
            if channel.views is not None:
                channel.views.ctl[fp.CTL_SERVER_PARKED] = 0
        self._housekeeping()

    def _event(self, kind: Any, fileobj: Any) -> None:
        if kind == "listen":
            self._accept()
        elif kind == "note":  # stop(), open(), a deferred record settled: the loop's conditions say which
            try:
                os.read(self.wake_r, 4096)
            except BlockingIOError:
                pass
        elif isinstance(kind, Handshake):
            token = self.handshakes.readable(kind)
            if token is not None:
                self._bind(kind.sock, token)
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
        """New connections, without waiting on any: a token already sent binds its channel now, the others wait
        in ``handshakes`` (read as their bytes come)."""
        for sock, token in self.handshakes.accept(self.listener, ACCEPTS_PER_EVENT):
            self._bind(sock, token)

    def _bind(self, sock: socket.socket, token: bytes) -> None:
        """A connection that sent a whole token: the pending channel's, or closed."""
        channel = self.registry.bind(token, sock)
        if channel is None:
            sock.close()
            return
        try:
            sock.send(b"k")  # bound: the client may send records
        except OSError:
            self._close(channel)
            return
        self.selector.register(sock, selectors.EVENT_READ, channel)

    def _close(self, channel: Channel) -> None:
        self.registry.remove(channel)
        self.fair.forget(channel)
        if channel.sock is not None:
            try:
                self.selector.unregister(channel.sock)
            except (KeyError, ValueError):
                pass
        channel.close()

    def check_invariants(self) -> None:
        self.registry.check_invariants()
        self.fair.check_invariants(list(self.registry.channels.values()))

    def stats(self) -> dict[str, int]:
        return {**self.registry.counts(), "served": self.served, "handshakes": len(self.handshakes)}
