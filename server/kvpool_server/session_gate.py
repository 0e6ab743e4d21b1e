"""SessionGate: what every mutating call passes first -- fencing, and safe retries.

- **Fencing.** A call that names a session (``session_id``) is served only while that session is live; the call
  renews its lease. A call from a session that ended (closed, lease expired, keep-alive broken, or one of an
  earlier server start) is refused with NOT_FOUND and a ``kvpool-error`` reason before it changes anything: a
  stopped process that wakes up after its session was reclaimed cannot write into blocks that are someone
  else's now.
- **Safe retries.** A call that carries a ``request_id`` (unique within its session) is remembered with its answer
  (``ReplyCache``); a repeat -- a client retrying after a lost reply or a passed deadline -- gets the first answer
  and is applied once.

Used by the servicer under its lock, around the core call::

    key, replay = gate.enter(request, pb.FreeResponse)      # raises if the session is not live
    if replay is not None:
        return replay
    response = ... the core ...
    return gate.remember(key, response)
"""

from __future__ import annotations

from typing import Any, TypeVar

from kvpool_server.core.sessions import SessionTable
from kvpool_server.replies import ReplyCache, fingerprint

R = TypeVar("R")
Key = tuple[int, int, bytes]  # (session_id, request_id, the request's fingerprint); request_id 0: not remembered


class SessionGate:
    def __init__(self, sessions: SessionTable, replies: ReplyCache) -> None:
        self.sessions = sessions
        self.replies = replies

    def enter(
        self, request: Any, response_cls: type[R], tenant: int | None = None
    ) -> tuple[Key | None, R | None]:
        """Renew the request's session (raising if it is not live, or not ``tenant``'s when given) and find a first
        answer to replay."""
        session_id = request.session_id
        if session_id:
            self.sessions.renew(session_id, tenant)
        request_id = getattr(request, "request_id", 0)
        if not request_id:
            return None, None
        key = (session_id, request_id, fingerprint(request.SerializeToString(deterministic=True)))
        cached = self.replies.lookup(*key)
        return key, (None if cached is None else response_cls.FromString(cached))  # type: ignore[attr-defined]

    def remember(self, key: Key | None, response: R) -> R:
        if key is not None:
            self.replies.store(*key, response.SerializeToString())  # type: ignore[attr-defined]
        return response
