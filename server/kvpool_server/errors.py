"""Core errors -> gRPC status codes, in one place.

The core raises before it changes anything, so a call that fails here has left the pool exactly as it was.

    SequenceNotFoundError    NOT_FOUND            the id is not live (never registered, or freed)
    SessionNotFoundError     NOT_FOUND            the session ended (closed, lease expired, keep-alive broken);
                                                  trailing metadata kvpool-error: session-not-found
    ServerRestartedError     NOT_FOUND            the session is an earlier server start's; kvpool-error:
                                                  server-restarted
    SequenceExistsError      ALREADY_EXISTS       a caller-chosen id is already live
    InvalidArgumentError     INVALID_ARGUMENT     the request can never succeed as written
    OutOfBlocksError         RESOURCE_EXHAUSTED   valid, but the pool (or sequence table) is full now
    FailedPreconditionError  FAILED_PRECONDITION  valid, but the current state forbids it (write to a shared block)
    InvariantViolationError  INTERNAL             a bug in kvpool
    ServerShuttingDownError  UNAVAILABLE          the server is draining before it stops; retry elsewhere/later
    anything else            INTERNAL             a bug in kvpool (logged with its traceback)
"""

from __future__ import annotations

import logging
from typing import NoReturn

import grpc

from kvpool_server.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolationError,
    KVPoolError,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
    ServerRestartedError,
    SessionNotFoundError,
)

logger = logging.getLogger(__name__)


class ServerShuttingDownError(KVPoolError):
    """The server got SIGTERM/SIGINT and takes no new calls (raised by the service, not the core)."""


STATUS_OF: dict[type[KVPoolError], grpc.StatusCode] = {
    SequenceNotFoundError: grpc.StatusCode.NOT_FOUND,
    SessionNotFoundError: grpc.StatusCode.NOT_FOUND,
    SequenceExistsError: grpc.StatusCode.ALREADY_EXISTS,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    OutOfBlocksError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    InvariantViolationError: grpc.StatusCode.INTERNAL,
    ServerShuttingDownError: grpc.StatusCode.UNAVAILABLE,
}


# Trailing metadata ``kvpool-error`` that tells the client which NOT_FOUND it is (kvpool_client/errors.py reads it).
REASON_KEY = "kvpool-error"
REASON_OF: dict[type[KVPoolError], str] = {
    ServerRestartedError: "server-restarted",
    SessionNotFoundError: "session-not-found",
}


def reason_of(exc: BaseException) -> str | None:
    return next((REASON_OF[cls] for cls in type(exc).__mro__ if cls in REASON_OF), None)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details string for an exception raised while serving a call."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[call-overload]
        if code is not None:
            message = str(exc) or cls.__name__
            if code is grpc.StatusCode.INTERNAL:
                message = f"kvpool bug: {message}"
            return code, message
    return grpc.StatusCode.INTERNAL, f"kvpool bug: {type(exc).__name__}: {exc}"


def abort(context: grpc.ServicerContext, exc: BaseException, rpc: str) -> NoReturn:
    """End the call with the status of ``exc`` (logging kvpool's own bugs); raises, as ``context.abort`` does."""
    code, message = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        logger.error("%s failed: %s", rpc, message, exc_info=None if isinstance(exc, KVPoolError) else exc)
    reason = reason_of(exc)
    if reason is not None:
        context.set_trailing_metadata(((REASON_KEY, reason),))
    context.abort(code, message)
