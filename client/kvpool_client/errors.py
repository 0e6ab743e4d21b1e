"""One exception tree for the client, mirroring gRPC status codes through one table.

    KVPoolClientError                 .code (grpc.StatusCode or None), .details, .method
     ├─ NotFoundError                 NOT_FOUND            unknown or freed seq_id
     │   └─ SessionLostError                               the client's session ended (lease expired, closed)
     │       └─ ServerRestartedError                       ... because the server restarted: every sequence is gone
     ├─ AlreadyExistsError            ALREADY_EXISTS       caller-supplied seq_id already live
     ├─ InvalidArgumentError          INVALID_ARGUMENT     can never succeed as written (a ValueError)
     ├─ ResourceExhaustedError        RESOURCE_EXHAUSTED   not enough free blocks now (retry after a Free)
     ├─ FailedPreconditionError       FAILED_PRECONDITION  valid, but the state forbids it (write to a shared block)
     ├─ UnavailableError              UNAVAILABLE          server down, restarting or shutting down
     │   ├─ ConnectionFailedError                          could not connect: the message names the cause and the
     │   │                                                 fix (diagnose.py: no server, TLS mismatch, metrics port)
     │   └─ ServerGoneError                                the keep-alive lost the server for longer than the lease
     ├─ DeadlineExceededError         DEADLINE_EXCEEDED    the call's deadline passed (a TimeoutError)
     ├─ InternalError                 INTERNAL             a server bug, e.g. a violated invariant
     ├─ CancelledError                CANCELLED
     ├─ UnauthenticatedError          UNAUTHENTICATED      no token, or one the server does not know (or revoked)
     ├─ PermissionDeniedError         PERMISSION_DENIED    the token's role may not make this call (admin RPCs)
     │   └─ AttachNotAllowedError                          the tenant may not map the pool (may_attach = false)
     ├─ PoolNotMappableError          (none; an OSError)   attach() where the pool is not visible: another host,
     │                                                     container or IPC namespace (use write_kv / read_kv)
     ├─ UnimplementedError            UNIMPLEMENTED
     └─ UnknownError                  every other code

The caller catches one class per situation; `from_rpc_error` is the only place that reads status codes (and the
server's ``kvpool-error`` trailing metadata, which tells a lost session from an unknown sequence).
"""

from __future__ import annotations

import grpc


class KVPoolClientError(Exception):
    """Base of every error the client raises for a failed call."""

    code: grpc.StatusCode | None = None

    def __init__(self, details: str, *, code: grpc.StatusCode | None = None, method: str = "") -> None:
        super().__init__(details)
        self.details = details
        self.method = method
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        name = self.code.name if self.code is not None else "CLIENT"
        where = f" in {self.method}" if self.method else ""
        return f"{name}{where}: {self.details}"


class NotFoundError(KVPoolClientError):
    code = grpc.StatusCode.NOT_FOUND


class SessionLostError(NotFoundError):
    """The server does not know this client's session any more: its lease expired (the process was stopped or cut
    off for longer than the lease), it was closed, or the server restarted. Its sequences are gone; open a new
    client (session) and start the requests again."""


class ServerRestartedError(SessionLostError):
    """The session belongs to an earlier start of the server: the restart lost every session and sequence."""


class AlreadyExistsError(KVPoolClientError):
    code = grpc.StatusCode.ALREADY_EXISTS


class InvalidArgumentError(KVPoolClientError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhaustedError(KVPoolClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class QuotaExceededError(ResourceExhaustedError):
    """The caller's tenant is at one of its quotas (the message names it); other tenants may still allocate."""


class FailedPreconditionError(KVPoolClientError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class UnavailableError(KVPoolClientError):
    code = grpc.StatusCode.UNAVAILABLE


class ConnectionFailedError(UnavailableError):
    """The client could not connect to its target. ``details`` says why and what to do (diagnose.py: nothing
    listening, a socket path without ``unix:``, plaintext to a TLS port or TLS to a plaintext one, a missing client
    certificate, a CA that did not sign the server's certificate, the metrics port given as the target);
    ``grpc_details`` is gRPC's own string. ``permanent``: waiting will not cure it, so it is not retried."""

    def __init__(self, details: str, *, grpc_details: str = "", permanent: bool = False, method: str = "") -> None:
        super().__init__(details, method=method)
        self.grpc_details = grpc_details
        self.permanent = permanent


class ServerGoneError(UnavailableError):
    """The keep-alive has not reached the server for longer than the lease: it is dead or cut off. An attached
    pool refuses writes from then on (the memory it maps is no longer a live server's)."""


class DeadlineExceededError(KVPoolClientError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class InternalError(KVPoolClientError):
    code = grpc.StatusCode.INTERNAL


class CancelledError(KVPoolClientError):
    code = grpc.StatusCode.CANCELLED


class UnauthenticatedError(KVPoolClientError):
    """The server runs with --auth-tokens and this call carried no token, or one it does not know (never issued,
    mistyped, or revoked by a reload of its tokens file). Give the client ``token=``; the tools read it from
    ``--token-file FILE`` or KVPOOL_TOKEN (docs/security.md)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDeniedError(KVPoolClientError):
    """The token is valid but its role may not make this call (ListSessions, Drain, SubscribeEvents,
    CheckInvariants are an ``admin`` token's), or its tenant may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AttachNotAllowedError(PermissionDeniedError):
    """``attach()`` by a tenant that may not map the pool: the server left the mapping (shm name, CUDA IPC handle)
    out of DescribePool because the tenant's entry in the tokens file lacks ``may_attach = true``. Move KV through
    ``write_kv()`` / ``read_kv()`` (gRPC) instead, or have the operator grant ``may_attach``."""


class PoolNotMappableError(KVPoolClientError, OSError):
    """``attach()`` could not map the pool DescribePool names: its shared-memory segment (or CUDA IPC handle) is
    not reachable from this process -- the server runs on another host, or in another container or IPC namespace.
    Move KV through ``write_kv()`` / ``read_kv()`` (gRPC) instead, or run where the server's IPC namespace is."""


class UnimplementedError(KVPoolClientError):
    code = grpc.StatusCode.UNIMPLEMENTED


class UnknownError(KVPoolClientError):
    code = grpc.StatusCode.UNKNOWN


# The one mapping table: status code -> exception class. Codes not listed raise UnknownError (with the real code).
ERROR_FOR_CODE: dict[grpc.StatusCode, type[KVPoolClientError]] = {
    cls.code: cls
    for cls in (
        NotFoundError,
        AlreadyExistsError,
        InvalidArgumentError,
        ResourceExhaustedError,
        FailedPreconditionError,
        UnavailableError,
        DeadlineExceededError,
        InternalError,
        CancelledError,
        UnauthenticatedError,
        PermissionDeniedError,
        UnimplementedError,
        UnknownError,
    )
}


def from_rpc_error(error: grpc.RpcError, method: str = "") -> KVPoolClientError:
    """The client exception for a failed call (``error`` is a grpc.RpcError that is also a grpc.Call)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = (error.details() if hasattr(error, "details") else None) or str(error)
    cls = ERROR_FOR_CODE.get(code, UnknownError)
    if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED):
        cls = REASONS.get(_reason(error), cls)
    return cls(details, code=code, method=method)


# The server's ``kvpool-error`` trailing metadata -> the class it means (kvpool_server/errors.py sets it).
REASONS: dict[str, type[KVPoolClientError]] = {
    "session-not-found": SessionLostError,
    "server-restarted": ServerRestartedError,
    "quota-exceeded": QuotaExceededError,
}


def _reason(error: grpc.RpcError) -> str:
    try:
        metadata = error.trailing_metadata() or ()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001  (an error raised before any call was made has none)
        return ""
    return next((value for key, value in metadata if key == "kvpool-error"), "")
