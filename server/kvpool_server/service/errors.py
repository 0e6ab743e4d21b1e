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
    StreamIdleError          UNAVAILABLE          a stream made no progress for --stream-idle-timeout-s; reopen it
    TooManyStreamsError      RESOURCE_EXHAUSTED   --max-streams streams are open; close one or raise the flag
    QuotaExceededError       RESOURCE_EXHAUSTED   the caller's tenant is at a quota (named in the message); kvpool-error:
                                                  quota-exceeded
    UnauthenticatedError     UNAUTHENTICATED      no token, or one the tokens file does not hold (revoked)
    PermissionDeniedError    PERMISSION_DENIED    the token's role may not call this RPC (a frontend calling an admin one),
                                                  or its tenant may not share prefixes (a public_prefix_len)

Another tenant's sequence or session is NOT_FOUND (SequenceNotFoundError / SessionNotFoundError), never
PERMISSION_DENIED: a tenant cannot learn that it exists.
    anything else            INTERNAL             a bug in kvpool (logged with its traceback)
"""

from __future__ import annotations

import grpc

from kvpool_server.core.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    InvariantViolationError,
    KVPoolError,
    OutOfBlocksError,
    QuotaExceededError,
    SequenceExistsError,
    SequenceNotFoundError,
    ServerRestartedError,
    SessionNotFoundError,
)


class ServerShuttingDownError(KVPoolError):
    """The server got SIGTERM/SIGINT and takes no new calls (raised by the service, not the core)."""


class DrainingError(KVPoolError):
    """The server was drained (the Drain RPC, ``kvctl drain``): it takes no new sessions or session-less sequences."""


class StreamIdleError(KVPoolError):
    """The server ended a stream that made no progress for ``--stream-idle-timeout-s`` (nothing was lost)."""


class TooManyStreamsError(KVPoolError):
    """``--max-streams`` streams are open: a new one is refused."""


class UnauthenticatedError(KVPoolError):
    """The call has no bearer token, or one the server does not know (never issued, or revoked by SIGHUP)."""


class PermissionDeniedError(KVPoolError):
    """The caller is known but its role (or its tenant's policy) may not make this call."""


STATUS_OF: dict[type[KVPoolError], grpc.StatusCode] = {
    SequenceNotFoundError: grpc.StatusCode.NOT_FOUND,
    SessionNotFoundError: grpc.StatusCode.NOT_FOUND,
    SequenceExistsError: grpc.StatusCode.ALREADY_EXISTS,
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    OutOfBlocksError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    InvariantViolationError: grpc.StatusCode.INTERNAL,
    ServerShuttingDownError: grpc.StatusCode.UNAVAILABLE,
    DrainingError: grpc.StatusCode.UNAVAILABLE,
    StreamIdleError: grpc.StatusCode.UNAVAILABLE,
    TooManyStreamsError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
}


# Trailing metadata ``kvpool-error`` that tells the client which NOT_FOUND it is (kvpool_client/errors.py reads it).
REASON_KEY = "kvpool-error"
REASON_OF: dict[type[KVPoolError], str] = {
    ServerRestartedError: "server-restarted",
    SessionNotFoundError: "session-not-found",
    QuotaExceededError: "quota-exceeded",
}


def trailing_metadata_of(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """``((kvpool-error, reason),)`` for the errors that carry a reason, else empty."""
    reason = next((REASON_OF[cls] for cls in type(exc).__mro__ if cls in REASON_OF), None)
    return () if reason is None else ((REASON_KEY, reason),)


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
