"""CallScope: what every call passes through, whatever its transport and kind -- written once.

    with scope.call("AppendToken", headers) as call:     # admission (counted; refused while shutting down),
        answer = service.append(call, ...)               #   authentication -> call.caller
                                                         # on the way out: the status of any exception (one
                                                         #   table, errors.py), quota refusals counted, kvpool's
                                                         #   own bugs logged, latency by RPC and status observed

A transport (grpc_api/, or a shared-memory channel) decodes its request, enters the scope, calls the service with
plain arguments and encodes the answer; when the body raises, ``call.status`` is the ``Status`` to send. The
service underneath takes the core's lock, fences sessions, replays retries and publishes KV events
(``guard.CoreGuard``), so no transport repeats any of it.

The kinds of call, all through ``call()``:

    unary            call(rpc, headers)                            one scope per call
    stream           call(rpc, headers, admit=False)               the whole stream: authenticated at its start,
                                                                   its latency observed once at its end
    stream message   call(rpc, headers, observe=False)             each message: admitted, authenticated again
                                                                   (a token revoked by SIGHUP ends its streams at
                                                                   their next message), refusals counted
    event stream     call(rpc, headers, admit=False)               never admitted: idle by design, it must not
                                                                   hold up a shutdown

An exception's status is computed once (the innermost scope) and kept on the exception, so a stream message's
refusal is counted once, not again by the stream around it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from kvpool_server.core.errors import KVPoolError, QuotaExceededError
from kvpool_server.service.admission import Admission
from kvpool_server.service.auth import ANONYMOUS, Authenticator, Identity
from kvpool_server.service.errors import Code, Status, status_of
from kvpool_server.service.metrics import KVPoolMetrics

logger = logging.getLogger(__name__)
_STATUS_ATTR = "_kvpool_status"
OK = Status(Code.OK, "")


class Headers(Protocol):
    """A call's request headers (gRPC metadata, or what another transport carries), read only when needed."""

    def get(self, key: str) -> str | None: ...


class NoHeaders:
    def get(self, key: str) -> str | None:
        return None


NO_HEADERS = NoHeaders()


def status_kept(exc: BaseException) -> Status:
    """``exc``'s status (CANCELLED for a cancellation), computed on first use and kept on the exception."""
    status = getattr(exc, _STATUS_ATTR, None)
    if status is None:
        status = status_of(exc) if isinstance(exc, Exception) else Status(Code.CANCELLED, "cancelled")
        try:
            setattr(exc, _STATUS_ATTR, status)
        except AttributeError:  # an exception type without a __dict__: computed again next time, same answer
            pass
    return status


class CallScope:
    """The scope's dependencies: admission, authentication (None without --auth-tokens), metrics (None when
    off)."""

    def __init__(self, admission: Admission, auth: Authenticator | None, metrics: KVPoolMetrics | None) -> None:
        self.admission = admission
        self.auth = auth
        self.metrics = metrics

    def call(self, rpc: str, headers: Headers = NO_HEADERS, *, admit: bool = True, observe: bool = True,
             stream: bool = False) -> Call:
        """``stream``: the call is a whole stream (its latency is its life: observed apart from unary calls')."""
        return Call(self, rpc, headers, admit, observe, stream)

    def failed(self, call: Call, exc: BaseException) -> Status:
        """The status of a call that raised ``exc``: counted and logged the first time a scope sees it."""
        first = getattr(exc, _STATUS_ATTR, None) is None
        status = status_kept(exc)
        if first:
            if status.code is Code.INTERNAL:
                logger.error("%s failed: %s", call.rpc, status.message,
                             exc_info=None if isinstance(exc, KVPoolError) else exc)
            elif isinstance(exc, QuotaExceededError) and self.metrics is not None:
                self.metrics.quota_refused(call.caller.tenant, status.message)
        return status


class Call:
    """One call (or stream message) inside the scope: who calls (``caller``), its headers, how it ended
    (``status``, once it has)."""

    __slots__ = ("scope", "rpc", "headers", "caller", "status", "_admit", "_observe", "_started", "_stream")

    def __init__(self, scope: CallScope, rpc: str, headers: Headers, admit: bool, observe: bool,
                 stream: bool = False) -> None:
        self.scope = scope
        self.rpc = rpc
        self.headers = headers
        self.caller: Identity = ANONYMOUS
        self.status: Status = OK
        self._admit = admit
        self._observe = observe and scope.metrics is not None
        self._started = time.perf_counter() if self._observe else 0.0
        self._stream = stream

    def __enter__(self) -> Call:
        scope = self.scope
        try:
            if self._admit:
                scope.admission.admit()  # counts the call, then may refuse it: released in __exit__ either way
            if scope.auth is not None:
                self.caller = scope.auth.identify(self.headers.get("authorization"), self.rpc)
        except BaseException as exc:
            self.__exit__(None, exc, None)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        scope = self.scope
        if self._admit:
            scope.admission.release()
        if exc is not None:
            self.status = scope.failed(self, exc)
        if self._observe:
            scope.metrics.observe_rpc(  # type: ignore[union-attr]
                self.rpc, self.status.code.name, time.perf_counter() - self._started, stream=self._stream)
