"""The session RPCs of KVPoolServicer (a mixin): OpenSession, KeepAlive, CloseSession, ListSessions,
ListSequences, and the end of a session -- one sweep that frees every sequence it holds.

A session ends in one of three ways, each through ``end_session`` under the servicer's lock:

    closed             CloseSession (the client library calls it from close())
    lease expired      no heartbeat or call named it for its lease TTL (``reap_expired``, run every 100 ms)
    keep-alive broken  its last KeepAlive stream ended without a CloseSession (the client process died: its
                       connection closed, and gRPC ends the stream at once)

Freeing is the manager's ``free``: a block shared with another session's sequence (a fork across sessions) only
loses this session's references, so copy-on-write sharing stays correct.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_server.auth import caller
from kvpool_server.core import InvalidArgumentError, KVCacheManager
from kvpool_server.core.errors import QuotaExceededError
from kvpool_server.core.sessions import Session, SessionTable
from kvpool_server.errors import DrainingError
from kvpool_server.metrics import SessionGauges
from kvpool_server.replies import ReplyCache

logger = logging.getLogger(__name__)
REAP_INTERVAL_S = 0.1  # how often ``reap_expired`` runs (grpc_server.build_server schedules it)


def _ms(seconds: float) -> int:
    return max(0, min(2**32 - 1, round(seconds * 1000)))


class SessionRpcs:
    """Needs ``manager``, ``lock``, ``sessions``, ``replies`` and ``on_session_end`` on the servicer."""

    manager: KVCacheManager
    lock: Any
    sessions: SessionTable
    replies: ReplyCache
    on_session_end: Callable[[str, float, int, int], None]
    draining_for_maintenance: bool  # set by the Drain RPC, never unset (restart the server to serve again)
    on_drain: Callable[[], None]  # health NOT_SERVING (grpc_server wires it)

    def open_session(self, request: pb.OpenSessionRequest) -> pb.OpenSessionResponse:
        self.refuse_if_drained("OpenSession")
        tenant = caller().tenant_id or 0
        with self.lock:
            limit = self.manager.tenants.limits[tenant].max_sessions
            if limit is not None and self.sessions.num_sessions(tenant) >= limit:
                raise QuotaExceededError(f"tenant {self.manager.tenants.names[tenant]!r} quota max_sessions={limit} "
                                         "(all open): close one first")
            session = self.sessions.open(request.client_name, request.lease_ttl_ms / 1000.0, tenant)
        return pb.OpenSessionResponse(
            session_id=session.session_id, server_epoch=self.sessions.server_epoch,
            lease_ttl_ms=_ms(session.lease_ttl_s),
        )

    def close_session(self, request: pb.CloseSessionRequest) -> pb.CloseSessionResponse:
        tenant = caller().tenant_id
        with self.lock:
            self.sessions.get(request.session_id, tenant)  # another tenant's: NOT_FOUND
            num_sequences, num_blocks = self.end_session(request.session_id, "closed")
        return pb.CloseSessionResponse(num_sequences_freed=num_sequences, num_blocks_freed=num_blocks)

    def end_session(self, session_id: int, reason: str, since: float | None = None) -> tuple[int, int]:
        """Forget the session and free its sequences (under the lock); returns (sequences, blocks) freed.
        ``since``: when the end was noticed (time.monotonic()), for the reclamation latency."""
        session = self.sessions.close(session_id)
        seq_ids = self.manager.seq_ids_of_session(session_id)
        num_blocks = self.manager.free(seq_ids) if seq_ids else 0
        self.replies.drop_session(session_id)
        latency = time.monotonic() - since if since is not None else 0.0
        self.on_session_end(reason, latency, len(seq_ids), num_blocks)
        logger.info("session %d (%s) ended, %s: %d sequences, %d blocks freed", session_id, session.client_name,
                    reason, len(seq_ids), num_blocks)
        return len(seq_ids), num_blocks

    def reap_expired(self) -> int:
        """End every session whose lease has passed; returns how many."""
        with self.lock:
            expired = self.sessions.expired()
            for session in expired:
                self.end_session(session.session_id, "lease expired", since=session.deadline)
        return len(expired)

    # ---------------------------------------------------------------- drain (maintenance)

    def refuse_if_drained(self, rpc: str) -> None:
        if self.draining_for_maintenance:
            raise DrainingError(
                f"{rpc}: kvpool-server is draining (kvctl drain): it takes no new sessions or session-less "
                "sequences; live sessions go on until they end"
            )

    def Drain(self, request: pb.DrainRequest, context: Any) -> pb.DrainResponse:
        """Start draining (once); answer what is still live."""
        if not self.draining_for_maintenance:
            self.draining_for_maintenance = True
            self.on_drain()
            logger.warning("draining: no new sessions; %d live sessions go on", len(self.sessions))
        with self.lock:
            return pb.DrainResponse(num_sessions=len(self.sessions), num_sequences=self.manager.num_sequences)

    # ---------------------------------------------------------------- the RPCs (handlers.py registers them by name)
    def OpenSession(self, request: pb.OpenSessionRequest, context: Any) -> pb.OpenSessionResponse:
        return self.open_session(request)

    def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        return self.close_session(request)

    def ListSessions(self, request: pb.ListSessionsRequest, context: Any) -> pb.ListSessionsResponse:
        return self.list_sessions(request)

    def ListSequences(self, request: pb.ListSequencesRequest, context: Any) -> pb.ListSequencesResponse:
        return self.list_sequences(request)

    # ---------------------------------------------------------------- KeepAlive, one stream's life
    def keep_alive_message(self, state: dict[str, Any], request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        """One heartbeat: the first names the session (and counts the stream open), each renews the lease."""
        with self.lock:
            session: Session | None = state.get("session")
            if session is None:
                session = self.sessions.stream_opened(request.session_id, state.get("tenant"))
                state["session"] = session
            else:
                if request.session_id not in (0, session.session_id):
                    raise InvalidArgumentError("a KeepAlive stream keeps one session alive; open another stream")
                self.sessions.renew(session.session_id)
            return pb.KeepAliveResponse(lease_remaining_ms=_ms(self.sessions.remaining_s(session)))

    def keep_alive_ended(self, state: dict[str, Any]) -> None:
        """The stream ended, however: if it was its session's last and the session was not closed, end it."""
        session: Session | None = state.get("session")
        if session is None:
            return
        since = time.monotonic()
        with self.lock:
            if self.sessions.stream_closed(session):
                self.end_session(session.session_id, "keep-alive broken", since=since)

    def session_gauges(self) -> SessionGauges:
        """For the metrics scrape: live sessions, and blocks still held by sequences of sessions that ended (the
        sweep frees them with the end, so this reads 0)."""
        with self.lock:
            ended = [sid for sid in self.manager.seqs_of_session if sid not in self.sessions]
            usage = self.manager.session_usage() if ended else {}
            ledger = self.manager.tenants
            tenants = tuple((name, ledger.num_blocks[t], ledger.num_sequences[t])
                            for t, name in enumerate(ledger.names) if name) if self.manager.tenancy else ()
            return SessionGauges(len(self.sessions), sum(usage[sid][1] for sid in ended), tenants)

    # ---------------------------------------------------------------- listing
    def list_sessions(self, request: pb.ListSessionsRequest) -> pb.ListSessionsResponse:
        with self.lock:
            usage = self.manager.session_usage()
            sessions = [
                pb.SessionInfo(
                    session_id=s.session_id, client_name=s.client_name, opened_unix_ms=s.opened_unix_ms,
                    lease_ttl_ms=_ms(s.lease_ttl_s), lease_remaining_ms=_ms(self.sessions.remaining_s(s)),
                    keep_alive_open=s.num_keep_alive_streams > 0,
                    num_sequences=usage.get(s.session_id, (0, 0))[0], num_blocks=usage.get(s.session_id, (0, 0))[1],
                )
                for s in self.sessions.sessions()
            ]
        return pb.ListSessionsResponse(sessions=sessions, server_epoch=self.sessions.server_epoch)

    def list_sequences(self, request: pb.ListSequencesRequest) -> pb.ListSequencesResponse:
        with self.lock:
            if request.session_id:
                self.sessions.get(request.session_id)  # NOT_FOUND for a session that is not live
            infos = self.manager.sequence_infos(request.session_id or None)
        return pb.ListSequencesResponse(
            sequences=[pb.SequenceInfo(seq_id=i[0], session_id=i[1], num_tokens=i[2], num_blocks=i[3]) for i in infos]
        )


class KeepAlive:
    """KeepAlive as a ``streams.StreamMethod``: ``close`` -- which runs however the stream ends, within milliseconds
    of the client process dying -- ends the session if the stream was its last and it was not closed."""

    request_cls = pb.KeepAliveRequest

    def __init__(self, servicer: SessionRpcs) -> None:
        self.servicer = servicer

    def open(self, context: Any) -> dict[str, Any]:
        return {"tenant": caller().tenant_id}

    def message(self, state: dict[str, Any], request: pb.KeepAliveRequest) -> pb.KeepAliveResponse:
        return self.servicer.keep_alive_message(state, request)

    def close(self, state: dict[str, Any], reason: str) -> None:
        try:
            self.servicer.keep_alive_ended(state)
        except Exception:  # a hook must not raise; a bug here is logged, and the lease still ends the session
            logger.exception("ending the session of a closed KeepAlive stream failed")
