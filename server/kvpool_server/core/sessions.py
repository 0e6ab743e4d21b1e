"""SessionTable: who is alive. Sessions, their leases, and when each one ends.

A session is a frontend's claim on the pool: every sequence it registers (or forks) belongs to it, and when the
session ends -- closed, its lease expired, or its keep-alive stream broken -- the server frees all of them in one
sweep. Which sequences a session holds is the manager's record (``KVCacheManager`` keeps each row's session), so
there is one source of truth for ownership; this table keeps only what a session *is*: its id, name, lease and
open keep-alive streams.

Ids: ``session_id = server_epoch << 32 | n`` with ``n`` counting up from 1 and ``server_epoch`` 32 random bits
drawn at every start, so an id never means two sessions within one start, and an id from an earlier start is
recognised as such (``ServerRestartedError``) instead of being taken for another session.

A lease is a deadline on the monotonic clock, renewed by every keep-alive message (and every call that names the
session). A session with an open keep-alive stream does not expire by time alone while messages come; when the
last stream breaks, the server ends the session at once (``end_reason`` "keep-alive stream broken").

Invariants (``check_invariants``): every live session's id carries this start's epoch and a counter below
``_next_number``; ``num_keep_alive_streams`` is never negative; no live session's id is 0.
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool_server.core.errors import (
    InvalidArgumentError,
    InvariantViolationError,
    ServerRestartedError,
    SessionNotFoundError,
)

NO_SESSION = 0  # the session of a sequence registered without one: never reclaimed


@dataclass(slots=True)
class Session:
    session_id: int
    client_name: str
    opened_unix_ms: int
    lease_ttl_s: float
    deadline: float  # on the table's monotonic clock
    num_keep_alive_streams: int = 0
    tenant: int = 0  # the tenant that opened it (0 without authentication); other tenants cannot name it


def new_server_epoch() -> int:
    """32 random bits, never 0: a new one at every server start."""
    while True:
        epoch = int.from_bytes(os.urandom(4), "little")
        if epoch:
            return epoch


class SessionTable:
    """The live sessions by id, with leases on an injectable monotonic clock (tests step it by hand)."""

    def __init__(
        self,
        server_epoch: int,
        *,
        default_ttl_s: float = 10.0,
        max_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < server_epoch < 2**32:
            raise InvalidArgumentError(f"server_epoch must be in [1, 2**32), got {server_epoch}")
        if not 0 < default_ttl_s <= max_ttl_s:
            raise InvalidArgumentError(f"need 0 < default_ttl_s <= max_ttl_s, got {default_ttl_s}, {max_ttl_s}")
        self.server_epoch: int = server_epoch
        self.default_ttl_s: float = default_ttl_s
        self.max_ttl_s: float = max_ttl_s
        self._clock = clock
        self._sessions: dict[int, Session] = {}
        self._next_number: int = 1

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: int) -> bool:
        return session_id in self._sessions

    def sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def page(self, after: int, limit: int) -> tuple[list[Session], bool]:
        """Up to ``limit`` live sessions with ids above ``after``, by id, and whether more follow. The table
        keeps sessions in the order they opened, which is id order (the counter only grows)."""
        ids = list(self._sessions)
        start = bisect.bisect_right(ids, after)
        chosen = ids[start:start + limit]
        return [self._sessions[i] for i in chosen], start + limit < len(ids)

    def open(self, client_name: str = "", lease_ttl_s: float = 0.0, tenant: int = 0) -> Session:
        """A new session; ``lease_ttl_s`` 0 takes the default, anything above the maximum is capped."""
        if lease_ttl_s < 0:
            raise InvalidArgumentError(f"lease_ttl_ms must be >= 0, got {lease_ttl_s * 1000:g}")
        if self._next_number >= 2**32:
            raise InvalidArgumentError("this server start has handed out 2**32 - 1 sessions; restart it")
        ttl = min(lease_ttl_s or self.default_ttl_s, self.max_ttl_s)
        session_id = self.server_epoch << 32 | self._next_number
        self._next_number += 1
        session = Session(session_id, client_name, int(time.time() * 1000), ttl, self._clock() + ttl, 0, tenant)
        self._sessions[session_id] = session
        return session

    def num_sessions(self, tenant: int) -> int:
        return sum(1 for s in self._sessions.values() if s.tenant == tenant)

    def get(self, session_id: int, tenant: int | None = None) -> Session:
        """The live session ``session_id`` (of ``tenant``, when given: another tenant's is not found); raises
        SessionNotFoundError (ServerRestartedError for an id of an earlier start)."""
        session = self._sessions.get(session_id)
        if session is not None and (tenant is None or session.tenant == tenant):
            return session
        epoch = session_id >> 32
        if epoch != self.server_epoch and 0 < epoch < 2**32:
            raise ServerRestartedError(
                f"session {session_id:#x} was opened on an earlier start of kvpool-server (epoch {epoch:#x}; this "
                f"start is epoch {self.server_epoch:#x}): a restart loses every session and sequence"
            )
        raise SessionNotFoundError(f"session {session_id:#x} is not live (never opened, closed, or its lease expired)")

    def renew(self, session_id: int, tenant: int | None = None) -> Session:
        """Push the lease deadline a full TTL ahead (a heartbeat, or any call naming the session)."""
        session = self.get(session_id, tenant)
        session.deadline = self._clock() + session.lease_ttl_s
        return session

    def remaining_s(self, session: Session) -> float:
        return max(0.0, session.deadline - self._clock())

    def close(self, session_id: int, tenant: int | None = None) -> Session:
        """Forget the session (the caller frees its sequences)."""
        session = self.get(session_id, tenant)
        del self._sessions[session_id]
        return session

    def expired(self) -> list[Session]:
        """Sessions whose lease deadline has passed (still in the table: the caller closes each)."""
        now = self._clock()
        return [s for s in self._sessions.values() if s.deadline <= now]

    def stream_opened(self, session_id: int, tenant: int | None = None) -> Session:
        session = self.renew(session_id, tenant)
        session.num_keep_alive_streams += 1
        return session

    def stream_closed(self, session: Session) -> bool:
        """A keep-alive stream of ``session`` ended; True when it was the session's last open one (then the caller
        ends the session, if it is still live)."""
        session.num_keep_alive_streams -= 1
        return session.num_keep_alive_streams == 0 and session.session_id in self._sessions

    def check_invariants(self) -> None:
        for session_id, session in self._sessions.items():
            if session_id != session.session_id or session_id >> 32 != self.server_epoch:
                raise InvariantViolationError(f"session {session_id} is filed under the wrong id or epoch")
            if not 0 < session_id & 0xFFFFFFFF < self._next_number:
                raise InvariantViolationError(f"session {session_id} has a number this start never handed out")
            if session.num_keep_alive_streams < 0:
                raise InvariantViolationError(f"session {session_id} has a negative keep-alive stream count")
