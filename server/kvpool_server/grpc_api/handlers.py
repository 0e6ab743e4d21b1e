"""What makes a servicer method an RPC on the grpc.aio server, in one place: raw request bytes -> the parsed message
-> admission through the ``Drain`` -> the servicer's plain synchronous method -> the serialized reply; a raised
error -> its status (``errors.py``); metrics by method and status code.

Handlers are registered with no request deserializer and no response serializer, so the bytes of a request that
does not parse never reach gRPC's own deserializer (which answers INTERNAL, logs a traceback and leaked ~16 KB a
call on grpcio 1.84): here it is INVALID_ARGUMENT, nothing logged, nothing kept.

A unary servicer method is ``method(request, context) -> response``, called on the event loop thread: it must be
quick. Two escape hatches, both raised/returned by the method and handled here:

- ``return Offload(work, finish)``: ``work()`` (a big KV copy, a whole-manager check) runs on a copy thread and
  returns the response, serialized there too; ``finish()`` then runs on the loop once ``work`` has ended, whatever
  happened (even if the call was cancelled meanwhile).
- ``raise Wait(awaitable)``: not now; the handler awaits it and calls the method again (from the start).

A stream is a ``StreamMethod`` (``streams.py``): ``open(context) -> state``, ``message(state, request) ->
response`` per message, ``close(state, reason)`` exactly once when the stream ends for any reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvpool_server.auth import CALLER, caller
from kvpool_server.core import InvalidArgumentError, KVPoolError
from kvpool_server.core.errors import QuotaExceededError
from kvpool_server.drain import Drain
from kvpool_server.errors import status_of, trailing_metadata_of

logger = logging.getLogger(__name__)
BIG_MESSAGE_BYTES = 1 << 20  # requests longer than this are parsed on a copy thread, not on the event loop


@dataclass(frozen=True)
class Offload:
    """A servicer method's answer whose slow part must not run on the event loop (see the module docstring)."""

    work: Callable[[], Any]
    finish: Callable[[], None] | None = None


class Wait(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a servicer method that cannot act now: the handler awaits ``until`` and calls it again."""

    def __init__(self, until: Awaitable[Any]) -> None:
        super().__init__("wait")
        self.until = until


@dataclass
class CallContext:
    """What every handler shares: the Drain, the copy threads, the metrics (None when off) and the Authenticator
    (None without --auth-tokens: every caller is ``auth.ANONYMOUS``)."""

    drain: Drain
    executor: Executor
    metrics: Any = None  # kvpool_server.metrics.KVPoolMetrics
    auth: Any = None  # kvpool_server.auth.Authenticator

    def authenticate(self, context: Any, rpc: str) -> None:
        """Who calls (``auth.CALLER`` for the servicer, in this call's task); raises UNAUTHENTICATED /
        PERMISSION_DENIED errors."""
        if self.auth is not None:
            CALLER.set(self.auth.identify(context.invocation_metadata(), rpc))


def parse_request(request_cls: type, raw: bytes, rpc: str) -> Any:
    try:
        return request_cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgumentError(
            f"{rpc}: the request bytes are not a {request_cls.DESCRIPTOR.full_name} message ({exc})"
        ) from None


def error_status(exc: BaseException, rpc: str) -> tuple[grpc.StatusCode, str]:
    """The status of ``exc``; kvpool's own bugs are logged (with a traceback when not a KVPoolError)."""
    code, message = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("%s failed: %s", rpc, message, exc_info=None if isinstance(exc, KVPoolError) else exc)
    return code, message


def unary_handler(
    call: CallContext, rpc: str, method: Callable[[Any, Any], Any], request_cls: type,
    count: Callable[[Any, Any], None] | None = None,
) -> grpc.RpcMethodHandler:
    """``method`` as a unary-unary handler of raw bytes. ``count(metrics, response)`` counts what it did."""
    drain, executor = call.drain, call.executor
    parse = request_cls.FromString

    async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        started = time.perf_counter()
        code_name = "OK"
        try:
            try:
                drain.admit()  # counts the call, then may refuse it: released below either way
                if call.auth is not None:
                    call.authenticate(context, rpc)
                if len(raw) > BIG_MESSAGE_BYTES:
                    loop = asyncio.get_running_loop()
                    request = await loop.run_in_executor(executor, parse_request, request_cls, raw, rpc)
                else:
                    try:
                        request = parse(raw)
                    except DecodeError:
                        request = parse_request(request_cls, raw, rpc)  # raises with the message
                while True:
                    try:
                        response = method(request, context)
                        break
                    except Wait as wait:
                        await wait.until
                if isinstance(response, Offload):
                    # shield: a cancelled call must not run ``finish`` (unpin, ...) while ``work`` still runs
                    done = asyncio.get_running_loop().run_in_executor(executor, _work_and_serialize, response.work)
                    if response.finish is not None:
                        finish = response.finish
                        done.add_done_callback(lambda _: finish())
                    response, data = await asyncio.shield(done)
                else:
                    data = response.SerializeToString()
                if count is not None and call.metrics is not None:
                    count(call.metrics, response)
                return data
            finally:
                drain.release()
        except Exception as exc:
            code, message = error_status(exc, rpc)
            code_name = code.name
            if isinstance(exc, QuotaExceededError) and call.metrics is not None:
                call.metrics.quota_refused(caller().tenant, message)
            await context.abort(code, message, trailing_metadata_of(exc))
            raise  # unreachable: abort raises
        except asyncio.CancelledError:
            code_name = "CANCELLED"
            raise
        finally:
            if call.metrics is not None:
                call.metrics.observe_rpc(rpc, code_name, time.perf_counter() - started)

    return grpc.unary_unary_rpc_method_handler(handle)


def _work_and_serialize(work: Callable[[], Any]) -> tuple[Any, bytes]:
    response = work()
    return response, response.SerializeToString()
