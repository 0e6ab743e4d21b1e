"""Streams on the grpc.aio server: ``bidi_handler`` runs a ``methods.BidiStream`` (per-stream state, one service
call per message, an end-of-stream hook), ``OpenStreams`` caps them and sweeps the idle ones, and
``server_stream_handler`` runs a ``methods.ServerStream`` (SubscribeEvents).

A stream costs a coroutine, not a thread: idle, stalled (never reading) or busy streams never hold up other calls.
Its life::

    open(call) -> state             once, before the first message is read (raise to refuse the stream)
    message(call, state, request)   per message, on the event loop, in a call scope of its own (admitted,
                                    authenticated again, its refusals counted) like a unary call, its answer
                                    through the one adapter (service/answers.honour)
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
from functools import partial
from dataclasses import dataclass
from contextlib import aclosing
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvpool_server.grpc_api import fair_calls
from kvpool_server.grpc_api.fair_calls import MAX_TURN_WAIT_S
from kvpool_server.grpc_api.handlers import parse_request, request_bound
from kvpool_server.grpc_api.request_bounds import check_size
from kvpool_server.grpc_api.methods import BidiStream, ServerStream
from kvpool_server.grpc_api.status import MetadataHeaders, abort
from kvpool_server.service.errors import Code, ServerShuttingDownError, Status, StreamIdleError, TooManyStreamsError
from kvpool_server.service import answers
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import CallScope

logger = logging.getLogger(__name__)


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
        self.last_close_reason = ""  # for tests and logs

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

    def close(self, entry: OpenStream, reason: str) -> None:
        """``entry``'s stream ended, for ``reason`` (see the module docstring)."""
        self._open.discard(entry)
        self.last_close_reason = reason

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


async def write_or_gone(context: grpc.aio.ServicerContext, data: bytes) -> None:
    """Write one message of a stream; a write that fails means the client has gone, and the stream ends CANCELLED
    like any cancellation (not logged). A SIGKILLed client's socket is closed by its kernel at once: grpcio fails a
    write issued after that and before it cancels the call (ExecuteBatchError), and so does a write after the
    deadline. Bytes already serialized fail to write for no other reason."""
    try:
        await context.write(data)
    except Exception as exc:
        raise asyncio.CancelledError(f"the client went away ({type(exc).__name__} on a write)") from None


def _serialized(message: Any) -> bytes:
    return message.SerializeToString()


def bidi_handler(service: KVPoolService, scope: CallScope, rpc: str, method: BidiStream,
                 streams: OpenStreams) -> grpc.RpcMethodHandler:
    """``method`` as a stream-stream handler of raw bytes: one response per request, in order."""
    admission = scope.admission
    request_cls: Any = method.request_cls
    on_message = method.message
    parse = request_cls.FromString
    bound = request_bound(service, request_cls)

    async def handle(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        reason = "half-closed"
        state: Any = _NOT_OPEN
        entry: OpenStream | None = None
        loop = asyncio.get_running_loop()
        headers = MetadataHeaders(context)
        stream_call = scope.call(rpc, headers, admit=False, stream=True)  # the whole stream: its life, at its end
        try:
            with stream_call:
                try:
                    entry = streams.open(rpc)
                    state = method.open(service, stream_call)
                    while True:
                        if admission.draining:
                            admission.refuse()
                        entry.reading = True
                        raw = await context.read()
                        entry.reading = False
                        if raw is grpc.aio.EOF:
                            if context.cancelled():
                                reason, stream_call.status = "cancelled", Status(Code.CANCELLED, "cancelled")
                            return
                        entry.last_progress = loop.time()
                        with scope.call(rpc, headers, observe=False) as call:  # this message
                            check_size(bound, len(raw), rpc)  # before parsing it
                            started = time.perf_counter()
                            try:
                                request = parse(raw)
                            except DecodeError:
                                request = parse_request(request_cls, raw, rpc)
                            parsed_s = time.perf_counter() - started
                            request = await fair_calls.take_turn(service, call, request, MAX_TURN_WAIT_S)
                            started = time.perf_counter()
                            data = answers.honour(partial(on_message, service, call, state, request), _serialized)
                            if isinstance(data, answers.Pending):  # a Wait (an Offload has no stream reply)
                                data = await data.settle(None)
                            fair_calls.charge(service, call, request, parsed_s + time.perf_counter() - started)
                        await write_or_gone(context, data)  # a killed client: a disconnect, not a bug
                        entry.last_progress = loop.time()
                except asyncio.CancelledError:
                    if entry is None or entry.end_with is None:
                        if reason == "half-closed":
                            reason = "shutdown" if admission.draining else "cancelled"
                        raise
                    task = asyncio.current_task()
                    if task is not None:
                        task.uncancel()
                    reason = "idle" if isinstance(entry.end_with, StreamIdleError) else "shutdown"
                    raise entry.end_with from None
        except Exception as exc:
            if reason == "half-closed":
                reason = "shutdown" if isinstance(exc, ServerShuttingDownError) else "error"
            await abort(context, stream_call.status)
        finally:
            if entry is not None:
                streams.close(entry, reason)
            if state is not _NOT_OPEN:
                try:
                    method.close(service, state, reason)
                except Exception:
                    logger.exception("%s: the end-of-stream hook failed", rpc)

    return grpc.stream_stream_rpc_method_handler(handle)


def server_stream_handler(service: KVPoolService, scope: CallScope, rpc: str,
                          method: ServerStream) -> grpc.RpcMethodHandler:
    """``method`` as a unary-stream handler of raw bytes. Never admitted (idle by design, it must not hold up a
    shutdown): refused while draining, ended within ``POLL_S`` once draining starts. A stream the service ends
    (``method.shed``: a slow consumer shed for a new one) ends with that error's status; one whose client went away
    ends CANCELLED (``write_or_gone``)."""
    admission = scope.admission

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> None:
        call = scope.call(rpc, MetadataHeaders(context), admit=False, stream=True)
        task = asyncio.current_task()
        try:
            with call:
                request = parse_request(method.request_cls, raw, rpc)
                if admission.draining:
                    admission.refuse()
                try:
                    async with aclosing(method.follow(service, call, request, lambda: admission.draining)) as answers:
                        async for answer in answers:
                            await write_or_gone(context, method.encode(service, answer).SerializeToString())
                except asyncio.CancelledError:
                    shed = method.shed(service, task)  # the service ended it (a slow consumer), not the client
                    if shed is None or task is None:
                        raise
                    task.uncancel()
                    raise shed from None
        except Exception:
            await abort(context, call.status)

    return grpc.unary_stream_rpc_method_handler(handle)
