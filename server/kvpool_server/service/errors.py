"""Errors -> status codes, in one place, for every transport.

The codes are the canonical status codes (``google.rpc.Code``, the numbers gRPC uses); ``Code`` names them without
importing grpc, so that the service layer and any transport share one table: the gRPC handlers turn a ``Status``
into ``grpc.StatusCode[code.name]`` (grpc_api/status.py), a record-based transport writes ``code.value``.

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
    TooManySessionsError     RESOURCE_EXHAUSTED   --max-sessions sessions are open, server-wide
    SlowSubscriberError      RESOURCE_EXHAUSTED   a SubscribeEvents subscriber that did not read was shed for a new one
    TooManyBytesError        RESOURCE_EXHAUSTED   --max-inflight-bytes of large requests are in flight; retry later
    SharedMemoryFullError    RESOURCE_EXHAUSTED   /dev/shm has no room for a new fast-path channel (use gRPC)
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

import enum
from typing import NamedTuple

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


class Code(enum.IntEnum):
    """The canonical status codes kvpool answers with (their gRPC numbers)."""

    OK = 0
    CANCELLED = 1
    INVALID_ARGUMENT = 3
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class Status(NamedTuple):
    """How a call ended: its code, the message for the caller, and the reason (``kvpool-error``), if any."""

    code: Code
    message: str
    reason: str = ""


class ServerShuttingDownError(KVPoolError):
    """The server got SIGTERM/SIGINT and takes no new calls (raised by the service, not the core)."""


class DrainingError(KVPoolError):
    """The server was drained (the Drain RPC, ``kvctl drain``): it takes no new sessions or session-less sequences."""


class StreamIdleError(KVPoolError):
    """The server ended a stream that made no progress for ``--stream-idle-timeout-s`` (nothing was lost)."""


class TooManyStreamsError(KVPoolError):
    """``--max-streams`` streams are open: a new one is refused."""


class SlowSubscriberError(KVPoolError):
    """A SubscribeEvents subscriber that did not read its stream was ended to make room for a new one."""


class TooManySessionsError(KVPoolError):
    """``--max-sessions`` sessions are open, server-wide: a new one is refused."""


class TooManyBytesError(KVPoolError):
    """``--max-inflight-bytes`` of large request bodies are being served, and this one cannot wait for room."""


class SharedMemoryFullError(KVPoolError):
    """/dev/shm has not the room for a new segment (a fast-path channel): refused before anything was made."""


class UnauthenticatedError(KVPoolError):
    """The call has no bearer token, or one the server does not know (never issued, or revoked by SIGHUP)."""


class PermissionDeniedError(KVPoolError):
    """The caller is known but its role (or its tenant's policy) may not make this call."""


STATUS_OF: dict[type[KVPoolError], Code] = {
    SequenceNotFoundError: Code.NOT_FOUND,
    SessionNotFoundError: Code.NOT_FOUND,
    SequenceExistsError: Code.ALREADY_EXISTS,
    InvalidArgumentError: Code.INVALID_ARGUMENT,
    OutOfBlocksError: Code.RESOURCE_EXHAUSTED,
    FailedPreconditionError: Code.FAILED_PRECONDITION,
    InvariantViolationError: Code.INTERNAL,
    ServerShuttingDownError: Code.UNAVAILABLE,
    DrainingError: Code.UNAVAILABLE,
    StreamIdleError: Code.UNAVAILABLE,
    TooManyStreamsError: Code.RESOURCE_EXHAUSTED,
    TooManySessionsError: Code.RESOURCE_EXHAUSTED,
    SlowSubscriberError: Code.RESOURCE_EXHAUSTED,
    TooManyBytesError: Code.RESOURCE_EXHAUSTED,
    SharedMemoryFullError: Code.RESOURCE_EXHAUSTED,
    UnauthenticatedError: Code.UNAUTHENTICATED,
    PermissionDeniedError: Code.PERMISSION_DENIED,
}


# Trailing metadata ``kvpool-error`` that tells the client which NOT_FOUND it is (kvpool_client/errors.py reads it).
REASON_KEY = "kvpool-error"
REASON_OF: dict[type[KVPoolError], str] = {
    ServerRestartedError: "server-restarted",
    SessionNotFoundError: "session-not-found",
    QuotaExceededError: "quota-exceeded",
}


def reason_of(exc: BaseException) -> str:
    """The ``kvpool-error`` reason of the errors that carry one, else ""."""
    return next((REASON_OF[cls] for cls in type(exc).__mro__ if cls in REASON_OF), "")


def status_of(exc: BaseException) -> Status:
    """The status of an exception raised while serving a call (INTERNAL, "kvpool bug: ...", for anything else)."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)
        if code is not None:
            message = str(exc) or cls.__name__
            if code is Code.INTERNAL:
                message = f"kvpool bug: {message}"
            return Status(code, message, reason_of(exc))
    return Status(Code.INTERNAL, f"kvpool bug: {type(exc).__name__}: {exc}")
