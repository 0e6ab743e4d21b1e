"""The client's end of a fast-path channel (docs/fast-path.md): write a request record, publish it, wait for the
reply record -- spinning SPIN_S, then parked on the channel's unix socket.

    channel = FastChannel.connect(open_fast_path_response)     # map the segment, connect, send the token
    result = channel.append(ids, counts, token_ids, request_id, "AppendToken", timeout)

A reply with a status raises the exception of errors.py that gRPC's status would (same code, same
``kvpool-error`` reason); a fenced channel raises SessionLostError (its session ended) or UnavailableError (the
server is stopping); the socket closing without a fence (the server died) raises ServerGoneError at once. One
request at a time per channel (``lock``).
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import threading
import time
from typing import Any

import grpc

from kvpool import fastpath as fp
from kvpool import fastpath_codec as codec
from kvpool.fastpath_codec import memory_barrier
from kvpool_client.errors import (
    ERROR_FOR_CODE,
    REASONS,
    DeadlineExceededError,
    KVPoolClientError,
    ServerGoneError,
    SessionLostError,
    UnavailableError,
    UnknownError,
)

SPIN_S = 200e-6  # the reply usually comes within this (the server's work); after it, park on the socket
PARK_SLICE_S = 0.05  # a parked wait looks again this often (a wake lost to store/load reordering costs this)
CONNECT_TIMEOUT_S = 2.0
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def is_local_target(target: str) -> bool:
    """A unix socket or a loopback address: the server's shared memory is this host's."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    host = target.split("://", 1)[-1]
    host = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:host.find("]")]
    return host in ("localhost", "::1") or host.startswith("127.")


def error_for(code: int, message: str, reason: int, method: str) -> KVPoolClientError:
    """The exception gRPC's status would have raised (errors.from_rpc_error's table)."""
    status = STATUS_CODES.get(code, grpc.StatusCode.UNKNOWN)
    cls = ERROR_FOR_CODE.get(status, UnknownError)
    if status in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED) and 0 < reason < len(fp.REASONS):
        cls = REASONS.get(fp.REASONS[reason], cls)
    return cls(message, code=status, method=method)


class FastChannel:
    def __init__(self, mapping: Any, sock: socket.socket, response: Any) -> None:
        self.mapping = mapping
        self.sock = sock
        self.area_bytes = int(response.area_bytes)
        self.generation = int(response.generation)
        self.max_batch = int(response.max_batch)
        self.views: fp.Views | None = fp.Views(mapping, self.area_bytes)
        self.seq = 0
        self.lock = threading.Lock()  # one exchange at a time (KVPoolClient is thread-safe)
        self.async_lock: asyncio.Lock | None = None  # the same for AsyncKVPoolClient's coroutines
        self.broken: KVPoolClientError | None = None  # set once the channel cannot be used again

    @classmethod
    def connect(cls, response: Any) -> FastChannel:
        """Map the segment and bind the connection with the token; OSError/ValueError when that fails."""
        mapping = fp.open_segment(response.shm_name, int(response.segment_bytes))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            address = response.socket_address
            sock.settimeout(CONNECT_TIMEOUT_S)
            sock.connect("\0" + address[1:] if address.startswith("@") else address)
            sock.sendall(response.token)
            if sock.recv(1) != b"k":
                raise OSError("the server refused the fast-path connection")
            sock.setblocking(False)
            channel = cls(mapping, sock, response)
            ctl = channel.views.ctl if channel.views is not None else None
            if ctl is None or ctl[fp.CTL_MAGIC] != fp.MAGIC or ctl[fp.CTL_GENERATION] != channel.generation:
                raise OSError("the fast-path segment is not the one the server described")
            return channel
        except BaseException:
            sock.close()
            mapping.close()
            raise

    def close(self) -> None:
        with self.lock:  # an async exchange never parks holding it: it is never left held
            self.broken = self.broken or UnavailableError("the fast-path channel is closed")
            if self.views is not None:
                self.views.release()
                self.views = None
            self.sock.close()
            try:
                self.mapping.close()
            except BufferError:
                pass

    @property
    def fenced(self) -> bool:
        """The server closed the channel (its session ended, or it stops)."""
        views = self.views
        return views is None or bool(views.ctl_words[fp.CTL_FENCED])

    # ---------------------------------------------------------------- one exchange
    def fits(self, n_ids: int, n_counts: int, n_tokens: int, extra: int = 0, reply: int = 0) -> bool:
        return fp.request_bytes(n_ids, n_counts, n_tokens, extra) <= self.area_bytes and reply <= self.area_bytes

    def exchange(self, step: Any) -> Any:
        """A plan's ``Exchange`` step, blocking: write, publish, wait (spin, then park), read -- or raise."""
        with self.lock:
            views, seq = self._publish(step.write, step.method)
            self._wait(views, seq, step.method, step.timeout)
            return self._finish(views, step.read, step.method)

    async def exchange_async(self, step: Any) -> Any:
        """The same, awaited: the park waits on the event loop (``add_reader`` on the socket)."""
        if self.async_lock is None:
            self.async_lock = asyncio.Lock()
        async with self.async_lock:
            views, seq = self._publish(step.write, step.method)
            await self._wait_async(views, seq, step.method, step.timeout)
            return self._finish(views, step.read, step.method)

    def _publish(self, write: Any, method: str) -> tuple[fp.Views, int]:
        views = self._usable(method)
        seq = self.seq + 1
        write(views)
        codec.publish_request(views, seq)
        ctl = views.ctl_words  # the control words as Python ints (a memoryview: ~30 ns a look)
        self.seq = seq
        memory_barrier()
        if ctl[fp.CTL_SERVER_PARKED]:
            self._send_wake(method)
        return views, seq

    def _finish(self, views: fp.Views, read: Any, method: str) -> Any:
        error = codec.reply_error(views)
        if error is not None:
            code, reason, message = error
            raise error_for(code, message, reason, method)
        return read(views)

    def _usable(self, method: str) -> fp.Views:
        if self.broken is not None or self.views is None:
            error = self.broken or UnavailableError("the fast-path channel is closed")
            raise type(error)(error.details, code=error.code, method=method)
        fenced = self.views.ctl_words[fp.CTL_FENCED]
        if fenced:
            self._break(self._fence_error(fenced), method)
        return self.views

    def _fence_error(self, fenced: int) -> KVPoolClientError:
        if fenced == fp.FENCED_SESSION_ENDED:
            return SessionLostError("the session of this fast-path channel ended (lease expired, or closed)")
        if fenced == fp.FENCED_SERVER_STOPPING:
            return UnavailableError("kvpool-server is shutting down: the fast-path channel is closed")
        return UnavailableError("the server closed this fast-path channel (a request broke the record protocol)")

    def _break(self, error: KVPoolClientError, method: str) -> None:
        self.broken = error
        raise type(error)(error.details, code=error.code, method=method)

    def _send_wake(self, method: str) -> None:
        try:
            self.sock.send(b"w", socket.MSG_DONTWAIT)
        except BlockingIOError:
            pass  # the server has wakes it has not read yet: it is awake
        except OSError:
            self._break(ServerGoneError("the fast-path socket is closed: the server is gone"), method)

    def _wait(self, views: fp.Views, seq: int, method: str, timeout: float) -> None:
        ctl = views.ctl_words  # the control words as Python ints (a memoryview: ~30 ns a look)
        if self._spin(ctl, seq):
            return
        deadline = time.monotonic() + timeout
        ctl[fp.CTL_CLIENT_PARKED] = 1
        memory_barrier()
        try:
            while ctl[fp.CTL_REP_SEQ] != seq:
                remaining = self._check_parked(ctl, deadline, timeout, method)
                ready, _, _ = select.select([self.sock], [], [], min(remaining, PARK_SLICE_S))
                if ready:
                    self._drain(ctl, seq, method)
        finally:
            ctl[fp.CTL_CLIENT_PARKED] = 0

    def _spin(self, ctl: memoryview, seq: int) -> bool:
        """Look for the reply for SPIN_S, yielding the CPU at each look (another process that shares this core --
        a second frontend, the server itself -- runs instead of waiting for our spin to end)."""
        perf, yield_cpu = time.perf_counter, os.sched_yield
        spin_end = perf() + SPIN_S
        while ctl[fp.CTL_REP_SEQ] != seq:
            if perf() > spin_end:
                return False
            yield_cpu()
        return True

    def _check_parked(self, ctl: memoryview, deadline: float, timeout: float, method: str) -> float:
        """While parked: raise for a fence or a passed deadline; else the seconds left."""
        fenced = int(ctl[fp.CTL_FENCED])
        if fenced:
            self._break(self._fence_error(fenced), method)
        remaining = deadline - time.monotonic()
        if remaining <= 0:  # the request may still be applied: the channel is out of step, give it up
            self._break(DeadlineExceededError(
                f"no fast-path reply within {timeout:g} s", code=grpc.StatusCode.DEADLINE_EXCEEDED), method)
        return remaining

    def _drain(self, ctl: memoryview, seq: int, method: str) -> None:
        """Read the wake bytes; EOF without the reply: the server closed the channel, or died."""
        try:
            data = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data and ctl[fp.CTL_REP_SEQ] != seq:
            fenced = int(ctl[fp.CTL_FENCED])
            self._break(self._fence_error(fenced) if fenced else ServerGoneError(
                "the server closed the fast-path socket without an answer: it is gone"), method)

    async def _wait_async(self, views: fp.Views, seq: int, method: str, timeout: float) -> None:
        ctl = views.ctl_words  # the control words as Python ints (a memoryview: ~30 ns a look)
        if self._spin(ctl, seq):  # at most SPIN_S of the event loop: the reply usually comes within it
            return
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + timeout
        ctl[fp.CTL_CLIENT_PARKED] = 1
        memory_barrier()
        try:
            while ctl[fp.CTL_REP_SEQ] != seq:
                remaining = self._check_parked(ctl, deadline, timeout, method)
                woke = loop.create_future()
                loop.add_reader(self.sock, _resolve, woke)
                try:
                    await asyncio.wait_for(woke, min(remaining, PARK_SLICE_S))
                except TimeoutError:
                    pass
                finally:
                    loop.remove_reader(self.sock)
                if woke.done() and not woke.cancelled():
                    self._drain(ctl, seq, method)
        finally:
            ctl[fp.CTL_CLIENT_PARKED] = 0


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
