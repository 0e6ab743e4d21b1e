"""ReplyCache: the first answer to each recent request id, so that a retried mutation is applied once.

A mutating request may carry a ``request_id`` (unique within its session). The servicer looks the id up before
it applies anything: a repeat of a request it already answered gets that answer again, byte for byte, and changes
nothing; the same id with *different* request bytes is the caller's bug (INVALID_ARGUMENT), not a retry.

The window: the last ``max_entries_per_session`` answered ids of each session (and of the no-session pool, id 0),
evicted oldest first, and never more than ``max_bytes`` of cached answers over all sessions (evicting the oldest
answer of any session first). A session's entries
go when the session ends. A retry that comes after its entry was evicted is applied again -- the client library
retries only within a few seconds, far inside the window (docs/api.md).

Only successful answers are cached: a failed call changed nothing, so applying its retry is exactly right.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from kvpool_server.core.errors import InvalidArgumentError


def fingerprint(request_bytes: bytes) -> bytes:
    return hashlib.blake2b(request_bytes, digest_size=16).digest()


class ReplyCache:
    """Invariant: ``_oldest_first`` holds exactly the (session, request) keys of ``_by_session``, oldest first;
    ``num_bytes`` is the sum of the cached answers' lengths; no session holds more than
    ``max_entries_per_session`` answers."""

    def __init__(self, max_entries_per_session: int = 1024, max_bytes: int = 64 << 20) -> None:
        self.max_entries_per_session = max_entries_per_session
        self.max_bytes = max_bytes
        self._by_session: dict[int, OrderedDict[int, tuple[bytes, bytes]]] = {}
        self._oldest_first: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._oldest_first)

    def lookup(self, session_id: int, request_id: int, request_fingerprint: bytes) -> bytes | None:
        """The cached answer to a repeat of ``request_id``, or None if it is new (or fell out of the window)."""
        entries = self._by_session.get(session_id)
        hit = entries.get(request_id) if entries is not None else None
        if hit is None:
            return None
        if hit[0] != request_fingerprint:
            raise InvalidArgumentError(
                f"request_id {request_id} was already used in session {session_id} for a different request; "
                "a request id names one request (reuse it only to retry that same request)"
            )
        return hit[1]

    def store(self, session_id: int, request_id: int, request_fingerprint: bytes, reply: bytes) -> None:
        self._remove(session_id, request_id)
        self._by_session.setdefault(session_id, OrderedDict())[request_id] = (request_fingerprint, reply)
        self._oldest_first[(session_id, request_id)] = None
        self.num_bytes += len(reply)
        entries = self._by_session[session_id]
        if len(entries) > self.max_entries_per_session:
            self._remove(session_id, next(iter(entries)))
        while self.num_bytes > self.max_bytes and len(self._oldest_first) > 1:
            self._remove(*next(iter(self._oldest_first)))

    def drop_session(self, session_id: int) -> None:
        for request_id in list(self._by_session.get(session_id, ())):
            self._remove(session_id, request_id)

    def _remove(self, session_id: int, request_id: int) -> None:
        entries = self._by_session.get(session_id)
        if entries is None or request_id not in entries:
            return
        self.num_bytes -= len(entries.pop(request_id)[1])
        del self._oldest_first[(session_id, request_id)]
        if not entries:
            del self._by_session[session_id]
