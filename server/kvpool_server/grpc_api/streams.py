"""Bidirectional streams on the grpc.aio server: a ``StreamMethod`` (per-stream state, one call per message, an
end-of-stream hook), ``OpenStreams`` (the cap and the idle sweep) and ``stream_handler`` that runs one.

A stream costs a coroutine, not a thread: idle, stalled (never reading) or busy streams never hold up other calls.
Its life::

    open(context) -> state          once, before the first message is read (raise to refuse the stream)
    message(state, request) -> reply per message, on the event loop, admitted through the Drain like a unary call
    close(state, reason)            exactly once, however the stream ended, right when it ends:
        "half-closed"  no more messages: the client finished sending (every message answered; the call ends OK)
                       -- or its connection closed: a SIGKILLed client's socket is closed by its kernel at once,
                       which grpcio 1.84 reports as the end of its messages (the cancellation follows a moment
                       later), so the hook runs within milliseconds of the kill
        "error"        a message failed (its status ends the call; that message changed nothing)
        "cancelled"    the client cancelled, its deadline passed, or its connection died mid-message
        "idle"         no message read or reply written for ``--stream-idle-timeout-s`` (a stalled peer that is
                       still connected: a SIGSTOPped process, a client that never reads); the call ends UNAVAILABLE
        "shutdown"     the server is draining or stopping

Keepalive pings (``--keepalive-time-s``) find peers that vanished without closing their sockets (a cut network, a
dead host); their calls are then cancelled ("cancelled").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError

from kvpool_server.errors import ServerShuttingDownError, StreamIdleError, TooManyStreamsError, trailing_metadata_of
from kvpool_server.handlers import CallContext, error_status, parse_request

logger = logging.getLogger(__name__)


class StreamMethod(Protocol):
    """A bidirectional-stream RPC of the servicer, e.g. ``AppendTokenStream`` (service.py)."""

    request_cls: type

    def open(self, context: Any) -> Any:
        """New per-stream state; raise a KVPoolError to refuse the stream with its status."""

    def message(self, state: Any, request: Any) -> Any:
        """One request -> its response (quick, on the event loop); raise to end the stream with a status."""

    def close(self, state: Any, reason: str) -> None:
        """The stream has ended (see the module docstring for ``reason``); must not raise."""


@dataclass(eq=False)
class OpenStream:
    rpc: str
    task: asyncio.Task | None
    last_progress: float  # loop time of the last message read or reply written
    reading: bool = False  # waiting for the client's next message (no message of it in progress)
    end_with: Exception | None = None  # set just before ``task`` is cancelled: the status the stream ends with


class OpenStreams:
    """Every open stream: at most ``max_streams`` (more: RESOURCE_EXHAUSTED naming the flag); ``sweep()`` ends the
    ones that made no progress for ``idle_timeout_s`` (0: never)."""

    def __init__(self, max_streams: int, idle_timeout_s: float) -> None:
        self.max_streams = max_streams
        self.idle_timeout_s = idle_timeout_s
        self._open: set[OpenStream] = set()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, rpc: str) -> OpenStream:
        if len(self._open) >= self.max_streams:
            raise TooManyStreamsError(
                f"kvpool-server already has {len(self._open)} streams open, its limit (--max-streams="
                f"{self.max_streams}, KVPOOL_MAX_STREAMS): close a stream, or raise --max-streams"
            )
        entry = OpenStream(rpc, asyncio.current_task(), asyncio.get_running_loop().time())
        self._open.add(entry)
        return entry

    def close(self, entry: OpenStream) -> None:
        self._open.discard(entry)

    def sweep(self) -> int:
        """End (cancel) the streams idle for longer than the timeout; returns how many."""
        if not self.idle_timeout_s:
            return 0
        deadline = asyncio.get_running_loop().time() - self.idle_timeout_s
        stale = [s for s in self._open if s.last_progress < deadline and s.end_with is None]
        for entry in stale:
            self._end(entry, StreamIdleError(
                f"{entry.rpc} made no progress (no message read, no reply taken) for {self.idle_timeout_s:g} s "
                "(--stream-idle-timeout-s): the server ended it; open a new stream"
            ))
        return len(stale)

    def end_waiting(self, error: Exception) -> int:
        """End with ``error`` every stream waiting for its client's next message (shutdown: UNAVAILABLE at once,
        not CANCELLED when the listener closes); a stream with a message in progress ends after answering it."""
        waiting = [s for s in self._open if s.reading and s.end_with is None]
        for entry in waiting:
            self._end(entry, error)
        return len(waiting)

    @staticmethod
    def _end(entry: OpenStream, error: Exception) -> None:
        entry.end_with = error
        if entry.task is not None:
            entry.task.cancel()


_NOT_OPEN = object()


def stream_handler(
    call: CallContext, rpc: str, method: StreamMethod, streams: OpenStreams,
    count: Callable[[Any, Any], None] | None = None,
) -> grpc.RpcMethodHandler:
    """``method`` as a stream-stream handler of raw bytes: one response per request, in order."""
    drain = call.drain
    request_cls = method.request_cls
    parse = request_cls.FromString

    async def handle(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        started = time.perf_counter()
        code_name, reason = "OK", "half-closed"
        state: Any = _NOT_OPEN
        entry: OpenStream | None = None
        admitted = False
        loop = asyncio.get_running_loop()
        try:
            try:
                call.authenticate(context, rpc)  # once, for the whole stream
                entry = streams.open(rpc)
                state = method.open(context)
                while True:
                    if drain.draining:
                        drain.refuse()
                    entry.reading = True
                    raw = await context.read()
                    entry.reading = False
                    if raw is grpc.aio.EOF:
                        if context.cancelled():
                            reason, code_name = "cancelled", "CANCELLED"
                        return
                    entry.last_progress = loop.time()
                    admitted = True  # before admit, which counts and then may refuse
                    drain.admit()
                    try:
                        request = parse(raw)
                    except DecodeError:
                        request = parse_request(request_cls, raw, rpc)
                    response = method.message(state, request)
                    data = response.SerializeToString()
                    if count is not None and call.metrics is not None:
                        count(call.metrics, response)
                    await context.write(data)
                    entry.last_progress = loop.time()
                    admitted = False
                    drain.release()
            except asyncio.CancelledError:
                if entry is None or entry.end_with is None:
                    reason, code_name = ("shutdown" if drain.draining else "cancelled"), "CANCELLED"
                    raise
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
                reason = "idle" if isinstance(entry.end_with, StreamIdleError) else "shutdown"
                raise entry.end_with from None
        except Exception as exc:
            if reason == "half-closed":
                reason = "shutdown" if isinstance(exc, ServerShuttingDownError) else "error"
            code, message = error_status(exc, rpc)
            code_name = code.name
            await context.abort(code, message, trailing_metadata_of(exc))
        finally:
            if admitted:
                drain.release()
            if entry is not None:
                streams.close(entry)
            if state is not _NOT_OPEN:
                try:
                    method.close(state, reason)
                except Exception:
                    logger.exception("%s: the end-of-stream hook failed", rpc)
            if call.metrics is not None:
                call.metrics.observe_rpc(rpc, code_name, time.perf_counter() - started)

    return grpc.stream_stream_rpc_method_handler(handle)
