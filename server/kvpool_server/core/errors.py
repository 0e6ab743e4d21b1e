"""One exception tree for the whole core.

Every error is raised before any state changes: an operation that raises leaves the manager exactly as it was.
The service maps each class to one gRPC status code (kvpool_server/errors.py).
"""


class KVPoolError(Exception):
    """Base of every error kvpool raises on purpose."""


class SequenceNotFoundError(KVPoolError, KeyError):
    """A seq_id that is not live (never registered, or already freed)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class SequenceExistsError(KVPoolError):
    """A caller-supplied seq_id that is already live."""


class OutOfBlocksError(KVPoolError):
    """The request is valid but the pool has too few free blocks (or sequence rows) to serve it now."""


class InvalidArgumentError(KVPoolError, ValueError):
    """A request that can never succeed as written: zero counts, duplicates, positions out of range..."""


class FailedPreconditionError(KVPoolError):
    """A valid request the current state forbids, e.g. writing KV into a block that other sequences share."""


class InvariantViolationError(KVPoolError, AssertionError):
    """check_invariants() found a broken invariant: a bug in kvpool, never the caller's fault."""


class SessionNotFoundError(KVPoolError, KeyError):
    """A session_id that is not live: never opened, closed, or ended when its lease expired."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ServerRestartedError(SessionNotFoundError):
    """A session_id from an earlier start of the server: the restart lost that session and all its sequences."""


class QuotaExceededError(OutOfBlocksError):
    """A tenant's quota (max_blocks, max_sequences, max_sessions, or other tenants' reservations) refuses the request;
    the message names the quota. Another tenant may still allocate."""
