"""The client's session calls, written once for both clients (a mixin of KVPoolCommands): the session's id, epoch
and whether it was lost; the fields every mutating request carries (opening the session on first use); OpenSession,
ListSessions, ListSequences, and the CloseSession of ``close()``. What a session is: session.py, docs/sessions.md."""

from __future__ import annotations

import time
from abc import abstractmethod
from typing import Any

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client import convert, rpcs
from kvpool_client.command import command
from kvpool_client.errors import DeadlineExceededError, KVPoolClientError, SessionLostError, UnavailableError
from kvpool_client.plan import Plan
from kvpool_client.session import SessionState
from kvpool_client.types import SequenceInfo, SessionInfo


class SessionCommands:
    _session: SessionState

    @abstractmethod
    def _call(self, rpc: rpcs.Rpc, request: Any, timeout: float | None) -> Plan[Any]: ...

    @abstractmethod
    def _start_keep_alive(self) -> None:
        """Start holding the KeepAlive stream of the session just opened (a thread, or a task)."""

    @property
    def session_id(self) -> int | None:
        """This client's session, once opened (None before its first mutating call, or with session=False)."""
        return self._session.session_id

    @property
    def server_epoch(self) -> int | None:
        """The server start the session was opened on (a restart gives a new one)."""
        return self._session.server_epoch

    @property
    def server_lost(self) -> KVPoolClientError | None:
        """Why the session is over (ServerGoneError, SessionLostError, ServerRestartedError), or None."""
        return self._session.lost

    def _session_fields(self, method: str, timeout: float | None = None) -> Plan[dict[str, int]]:
        """``session_id`` and a fresh ``request_id`` for a mutating request, opening the session first if needed."""
        state = self._session
        if not state.enabled:
            return {}
        state.check_live(method)
        if state.session_id is None:
            sent_at = time.monotonic()
            response = yield from self._call(rpcs.OPEN_SESSION, state.open_request(), timeout)
            with state.lock:
                opened_here = state.session_id is None
                if opened_here:
                    state.opened(response, sent_at)
            if opened_here:
                self._start_keep_alive()
            else:  # another call of this client opened one meanwhile: give this one back
                yield from self._call(rpcs.CLOSE_SESSION, pb.CloseSessionRequest(session_id=response.session_id), None)
        return {"session_id": state.session_id, "request_id": state.next_request_id()}

    @command
    def open_session(self, *, timeout: float | None = None) -> Plan[int]:
        """Open this client's session now (it opens by itself on the first mutating call); returns its id."""
        yield from self._session_fields(rpcs.OPEN_SESSION.name, timeout)
        return self._session.session_id or 0

    @command
    def list_sessions(self, *, timeout: float | None = None) -> Plan[list[SessionInfo]]:
        """The server's live sessions, by id: id, name, since when, lease left, sequences and blocks held (every page
        of ListSessions)."""
        rows = yield from self._all_pages(rpcs.LIST_SESSIONS, pb.ListSessionsRequest(), "sessions", timeout)
        return [convert.session_info(s) for s in rows]

    @command
    def list_sequences(self, session_id: int | None = None, *, timeout: float | None = None) -> Plan[list[SequenceInfo]]:
        """The live sequences, by id, of one session (``session_id``) or of all (None) (every page of
        ListSequences)."""
        rows = yield from self._all_pages(rpcs.LIST_SEQUENCES, pb.ListSequencesRequest(session_id=session_id or 0),
                                          "sequences", timeout)
        return [convert.sequence_info(s) for s in rows]

    def _all_pages(self, rpc: Any, request: Any, field: str, timeout: float | None) -> Plan[list[Any]]:
        """Every row of a paged listing: ask again with ``page_token`` = the reply's ``next_page_token`` until it is
        empty (or repeats: a server that repeated a token would loop forever) -- pages.all_pages, as a plan."""
        rows: list[Any] = []
        seen: set[str] = set()
        while True:
            response = yield from self._call(rpc, request, timeout)
            rows.extend(getattr(response, field))
            token = response.next_page_token
            if not token or token in seen:
                return rows
            seen.add(token)
            request.page_token = token

    def _close_session(self) -> Plan[None]:
        """End this client's session (the server frees its sequences); nothing when none is open or it is lost."""
        state = self._session
        session_id, state.session_id = state.session_id, None
        if session_id is None or state.lost is not None:
            return
        try:
            yield from self._call(rpcs.CLOSE_SESSION, pb.CloseSessionRequest(session_id=session_id), None)
        except (SessionLostError, UnavailableError, DeadlineExceededError):
            pass  # already over (lease, restart) or no server to tell: its sequences are or will be freed
