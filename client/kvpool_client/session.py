"""What a client knows of its session, and the keep-alive that holds it open.

A client opens its session on its first call that creates or changes sequences (``OpenSession``), and from then on
holds one ``KeepAlive`` stream open in the background, sending a heartbeat every third of the lease. While the
stream is open the server knows the client is alive; when the client's process dies, its connection closes, the
stream breaks and the server frees every sequence of the session at once. ``close()`` ends the session itself
(``CloseSession``: all its sequences freed) before it closes the channel.

The keep-alive also tells the client when the server is gone: the stream failing with UNAVAILABLE (the server's
process died, or its socket vanished) and not coming back within the lease sets ``lost`` to ``ServerGoneError``;
the server answering that the session is not live (its lease expired while this process was stopped, say) sets it
to ``SessionLostError``, or ``ServerRestartedError`` when the server started again since. An attached pool refuses
writes once ``lost`` is set: the memory it maps is no longer the server's, or no longer this session's.

The lease, locally. A process that was stopped (SIGSTOP, a long GC pause, a swapped-out host) wakes up before its
keep-alive has had a chance to hear that the session is gone. So the state also keeps ``last_ack``: the monotonic
time at which a request that renewed the lease was *sent* (OpenSession, a heartbeat the server answered, a
mutating call naming the session that succeeded). The server renewed the lease no earlier than that, so it cannot
expire before ``last_ack + lease_ttl_s``; ``check_lease`` (run by every attached read and write) refuses with
``SessionLostError`` once ``now - last_ack > lease_ttl_s - lease_margin_s`` (``LEASE_MARGIN_FRACTION`` of the lease,
at least ``LEASE_MARGIN_MIN_S``): time for the data access itself to land (a GPU kernel is only enqueued). A
healthy client acknowledges every third of the lease, so the check never refuses a live session.

The sync client runs the keep-alive in a daemon thread (``KeepAliveThread``), the asyncio client in a task
(``keep_alive_task``); both share ``SessionState`` and the reconnect rule.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.errors import KVPoolClientError, ServerGoneError, SessionLostError, from_rpc_error

KEEP_ALIVE_METHOD = "KeepAlive"
RECONNECT_PAUSE_S = 0.1
LEASE_MARGIN_FRACTION = 0.1  # an attached access refuses this share of the lease before the server could expire it
LEASE_MARGIN_MIN_S = 0.05
MAX_HEARTBEATS_IN_FLIGHT = 64  # send times of unanswered heartbeats kept (one a third of a lease: never reached)


def default_client_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class SessionState:
    """The session's id once open, its lease, the next request id, and ``lost`` (None while all is well)."""

    def __init__(self, enabled: bool, client_name: str | None, lease_ttl_s: float | None) -> None:
        if lease_ttl_s is not None and lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.enabled = enabled
        self.client_name = client_name or default_client_name()
        self.requested_ttl_s = lease_ttl_s
        self.session_id: int | None = None
        self.server_epoch: int | None = None
        self.lease_ttl_s: float = 0.0
        self.lost: KVPoolClientError | None = None
        self.server_pid: int | None = None  # DescribePool's, once known: a dead server is then noticed at once
        self.last_ack: float | None = None  # monotonic send time of the last request that renewed the lease
        self._request_ids = itertools.count(1)
        self.lock = threading.Lock()

    def open_request(self) -> pb.OpenSessionRequest:
        ttl_ms = 0 if self.requested_ttl_s is None else max(1, round(self.requested_ttl_s * 1000))
        return pb.OpenSessionRequest(client_name=self.client_name, lease_ttl_ms=ttl_ms)

    def opened(self, response: pb.OpenSessionResponse, sent_at: float) -> None:
        self.session_id = response.session_id
        self.server_epoch = response.server_epoch
        self.lease_ttl_s = response.lease_ttl_ms / 1000.0
        self.acked(sent_at)

    def acked(self, sent_at: float) -> None:
        """The server answered a request sent at ``sent_at`` (monotonic) that renewed the lease."""
        if self.last_ack is None or sent_at > self.last_ack:
            self.last_ack = sent_at

    @property
    def lease_margin_s(self) -> float:
        return max(LEASE_MARGIN_MIN_S, LEASE_MARGIN_FRACTION * self.lease_ttl_s)

    def check_lease(self, what: str) -> None:
        """Raise ``SessionLostError`` when the server may have let the lease expire: nothing it acknowledged was
        sent within the lease (less the margin). Nothing to check without a session or before it opened."""
        if not self.enabled or self.last_ack is None or self.lease_ttl_s <= 0:
            return
        silent_s = time.monotonic() - self.last_ack
        if silent_s > self.lease_ttl_s - self.lease_margin_s:
            raise SessionLostError(
                f"refusing to {what}: the server acknowledged nothing of session {self.session_id} for "
                f"{silent_s:.3f} s, and its lease is {self.lease_ttl_s:g} s (refused {self.lease_margin_s:g} s "
                "early): the session may be over and these blocks someone else's (was this process stopped?)",
                method="AttachedPool")

    def next_request_id(self) -> int:
        return next(self._request_ids)

    @property
    def heartbeat_s(self) -> float:
        return max(0.05, self.lease_ttl_s / 3.0)

    def check_live(self, method: str) -> None:
        """Raise what ended the session, if anything did (before a call that would be refused anyway)."""
        if self.lost is not None:
            raise type(self.lost)(self.lost.details, code=self.lost.code, method=method)

    def keep_alive_failed(self, error: KVPoolClientError, gave_up: bool) -> bool:
        """Record a broken keep-alive stream; True when the client should stop trying (the session is over)."""
        if isinstance(error, SessionLostError):
            self.lost = error
            return True
        if gave_up or not _process_alive(self.server_pid):
            self.lost = ServerGoneError(
                f"no answer from the server for longer than the lease ({self.lease_ttl_s:g} s): {error.details}",
                code=error.code, method=KEEP_ALIVE_METHOD,
            )
            return True
        return False


class KeepAliveThread(threading.Thread):
    """Holds a KeepAlive stream open for the sync client; reconnects within the lease after a broken stream."""

    def __init__(self, state: SessionState, open_stream: Callable[[Iterator[pb.KeepAliveRequest]], Any]) -> None:
        super().__init__(name=f"kvpool-keepalive-{state.session_id}", daemon=True)
        self._state = state
        self._open_stream = open_stream
        self._stopping = threading.Event()  # not _stop: that is threading.Thread's own method (called after a fork)
        self._call: Any = None
        self._sent: deque[float] = deque(maxlen=MAX_HEARTBEATS_IN_FLIGHT)

    def _heartbeats(self) -> Iterator[pb.KeepAliveRequest]:
        request = pb.KeepAliveRequest(session_id=self._state.session_id)
        while not self._stopping.is_set():
            self._sent.append(time.monotonic())
            yield request
            self._stopping.wait(self._state.heartbeat_s)

    def run(self) -> None:
        state, broken_since = self._state, None
        while not self._stopping.is_set():
            try:
                self._sent.clear()
                self._call = self._open_stream(self._heartbeats())
                for _ in self._call:  # one answer per heartbeat, in order: the lease was renewed after its send
                    broken_since = None
                    if self._sent:
                        state.acked(self._sent.popleft())
                if self._stopping.is_set():
                    return
                raise grpc.RpcError()  # the server ended the stream: a drain; reconnect like a failure
            except grpc.RpcError as rpc_error:
                if self._stopping.is_set():
                    return
                error = from_rpc_error(rpc_error, KEEP_ALIVE_METHOD) if hasattr(rpc_error, "code") else ServerGoneError(
                    "the server ended the keep-alive stream", method=KEEP_ALIVE_METHOD)
                now = _monotonic()
                broken_since = broken_since or now
                if state.keep_alive_failed(error, gave_up=now - broken_since > state.lease_ttl_s):
                    return
                self._stopping.wait(RECONNECT_PAUSE_S)

    def stop(self) -> None:
        self._stopping.set()
        if self._call is not None:
            self._call.cancel()


async def keep_alive_task(state: SessionState, open_stream: Callable[[Any], Any]) -> None:
    """The asyncio client's keep-alive: the same stream and reconnect rule as KeepAliveThread; cancel to stop."""

    sent: deque[float] = deque(maxlen=MAX_HEARTBEATS_IN_FLIGHT)

    async def heartbeats() -> Any:
        request = pb.KeepAliveRequest(session_id=state.session_id)
        while True:
            sent.append(time.monotonic())
            yield request
            await asyncio.sleep(state.heartbeat_s)

    broken_since = None
    while True:
        sent.clear()
        try:
            async for _ in open_stream(heartbeats()):
                broken_since = None
                if sent:
                    state.acked(sent.popleft())
            error: KVPoolClientError = ServerGoneError("the server ended the keep-alive stream",
                                                       method=KEEP_ALIVE_METHOD)
        except grpc.RpcError as rpc_error:
            error = from_rpc_error(rpc_error, KEEP_ALIVE_METHOD)
        now = _monotonic()
        broken_since = broken_since or now
        if state.keep_alive_failed(error, gave_up=now - broken_since > state.lease_ttl_s):
            return
        await asyncio.sleep(RECONNECT_PAUSE_S)


def _process_alive(pid: int | None) -> bool:
    """False only when ``pid`` is known and no such process exists (this host, this pid namespace)."""
    if not pid:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _monotonic() -> float:
    return time.monotonic()
