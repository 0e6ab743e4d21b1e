"""SessionService: OpenSession, KeepAlive, CloseSession, ListSessions, ListSequences, the Drain RPC, and the end
of a session -- one sweep that frees every sequence it holds.

A session ends in one of three ways, each through ``end`` under the core's lock:

    closed             CloseSession (the client library calls it from close())
    lease expired      no heartbeat or call named it for its lease TTL (``reap_expired``, run every 100 ms)
    keep-alive broken  its last KeepAlive stream ended without a CloseSession (the client process died: its
                       connection closed, and the transport ends the stream at once)

Freeing is the manager's ``detach`` then the release of the rows (``freeing.free_rows``): at once when they fit
one lock hold, else in chunks on the loop after the session's end (its sequences are gone at once; CloseSession's
reply waits for the last chunk). A block shared with another session's sequence (a fork across sessions) only
loses this session's references, so copy-on-write sharing stays correct. The session's cached replies go too.

Draining for maintenance (the Drain RPC, ``kvctl drain``): no new sessions or session-less sequences; live
sessions go on until they end. Not the shutdown's refusal of every call (``admission.Admission``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

import numpy as np

from kvpool_server.core import InvalidArgumentError, KVCacheManager, listings
from kvpool_server.core.errors import QuotaExceededError
from kvpool_server.core.sessions import Session
from kvpool_server.service import paging
from kvpool_server.service.errors import DrainingError, TooManySessionsError
from kvpool_server.service.freeing import Freeing, free_rows
from kvpool_server.service.guard import CoreGuard
from kvpool_server.service.metrics import KVPoolMetrics, SessionGauges
from kvpool_server.service.answers import Offload
from kvpool_server.service.scope import Call

logger = logging.getLogger(__name__)
REAP_INTERVAL_S = 0.1  # how often ``reap_expired`` runs (grpc_api/server.py schedules it)


@dataclass
class KeepAliveState:
    """One KeepAlive stream: the session its first message named (None before)."""

    tenant: int | None
    session: Session | None = None


class SessionService:
    """The session RPCs. Bounds: at most ``max_sessions`` live sessions server-wide (``--max-sessions``; a
    tenant's ``max_sessions`` quota comes on top), a ``client_name`` of at most ``paging.MAX_CLIENT_NAME_BYTES``,
    and listings in pages that fit ``max_message_bytes`` (``paging``)."""

    def __init__(self, guard: CoreGuard, metrics: KVPoolMetrics | None, on_drain: Callable[[bool], None], *,
                 max_sessions: int = 4096, max_message_bytes: int = 64 << 20) -> None:
        self.guard = guard
        self.table = guard.sessions
        self.metrics = metrics
        self.on_drain = on_drain  # on_drain(True) at a drain: health NOT_SERVING; on_drain(False) at a resume: SERVING
        self.draining = False  # set by the Drain RPC, unset by Drain(resume=True)
        self.max_sessions = max_sessions  # --max-sessions
        self.max_message_bytes = max_message_bytes

    def open(self, call: Call, client_name: str = "", lease_ttl_ms: int = 0) -> Session:
        self.refuse_if_drained("OpenSession")
        paging.check_client_name(client_name)
        tenant = call.caller.tenant_id or 0
        manager = self.guard.manager
        with self.guard.lock:
            limit = manager.tenants.limits[tenant].max_sessions
            if limit is not None and self.table.num_sessions(tenant) >= limit:
                raise QuotaExceededError(f"tenant {manager.tenants.names[tenant]!r} quota max_sessions={limit} "
                                         "(all open): close one first")
            if len(self.table) >= self.max_sessions:
                raise TooManySessionsError(
                    f"kvpool-server already has {len(self.table)} sessions open, its limit (--max-sessions="
                    f"{self.max_sessions}, KVPOOL_MAX_SESSIONS): close one (or let its lease end), or raise the limit")
            return self.table.open(client_name, lease_ttl_ms / 1000.0, tenant)

    def close(self, call: Call, session_id: int) -> tuple[int, int] | Offload:
        """CloseSession: returns (sequences, blocks) freed (an Offload of that when the blocks are released in
        chunks: it waits for the last)."""
        with self.guard.lock:
            self.table.get(session_id, call.caller.tenant_id)  # another tenant's: NOT_FOUND
            num_seqs, freed = self.end(session_id, "closed")
        if isinstance(freed, int):
            return num_seqs, freed
        return Offload(lambda: (num_seqs, freed.wait()))

    def end(self, session_id: int, reason: str, since: float | None = None) -> tuple[int, int | Freeing]:
        """Forget the session and free its sequences (under the lock); returns (sequences, blocks) freed -- or,
        when the blocks are too many for one lock hold, the ``Freeing`` that releases them in chunks from the
        loop's next turn on (the sequences are gone already). ``since``: when the end was noticed
        (time.monotonic()), for the reclamation latency."""
        session = self.table.close(session_id)
        manager = self.guard.manager
        seq_ids = manager.seq_ids_of_session(session_id)
        freed = free_rows(self.guard, manager.detach(seq_ids)) if seq_ids else 0
        self.guard.replies.drop_session(session.tenant, session_id)
        if self.guard.events.log.pending:
            self.guard.events.publish()

        def reclaimed(num_blocks: int) -> None:
            if self.metrics is not None:
                latency = time.monotonic() - since if since is not None else 0.0
                self.metrics.session_reclaimed(reason, latency, len(seq_ids), num_blocks)
            logger.info("session %#x (%s) ended, %s: %d sequences, %d blocks freed", session_id,
                        session.client_name, reason, len(seq_ids), num_blocks)

        if isinstance(freed, int):
            reclaimed(freed)
        else:
            freed.then(reclaimed)
            freed.start(self.guard)
        return len(seq_ids), freed

    def reap_expired(self) -> int:
        """End every session whose lease has passed; returns how many."""
        with self.guard.lock:
            expired = self.table.expired()
            for session in expired:
                self.end(session.session_id, "lease_expired", since=session.deadline)
        return len(expired)

    # ---------------------------------------------------------------- drain (maintenance)
    def refuse_if_drained(self, rpc: str) -> None:
        if self.draining:
            raise DrainingError(
                f"{rpc}: kvpool-server is draining (kvctl drain): it takes no new sessions or session-less "
                "sequences; live sessions go on until they end"
            )

    def drain(self, resume: bool = False) -> tuple[int, int]:
        """Start draining (once), or with ``resume`` stop draining; returns what is still live: (sessions,
        sequences)."""
        if resume and self.draining:
            self.draining = False
            self.on_drain(False)
            logger.warning("drain undone: serving new sessions again")
        elif not resume and not self.draining:
            self.draining = True
            self.on_drain(True)
            logger.warning("draining: no new sessions; %d live sessions go on", len(self.table))
        with self.guard.lock:
            return len(self.table), self.guard.manager.num_sequences

    # ---------------------------------------------------------------- KeepAlive, one stream's life
    def keep_alive_opened(self, call: Call) -> KeepAliveState:
        return KeepAliveState(call.caller.tenant_id)

    def keep_alive(self, state: KeepAliveState, session_id: int) -> float:
        """One heartbeat: the first names the session (and counts the stream open), each renews the lease;
        returns the lease's remaining seconds."""
        with self.guard.lock:
            session = state.session
            if session is None:
                session = state.session = self.table.stream_opened(session_id, state.tenant)
            else:
                if session_id not in (0, session.session_id):
                    raise InvalidArgumentError("a KeepAlive stream keeps one session alive; open another stream")
                self.table.renew(session.session_id)
            return self.table.remaining_s(session)

    def keep_alive_ended(self, state: KeepAliveState) -> None:
        """The stream ended, however: if it was its session's last and the session was not closed, end it.
        Never raises (a bug here is logged, and the lease still ends the session)."""
        session = state.session
        if session is None:
            return
        since = time.monotonic()
        try:
            with self.guard.lock:
                if self.table.stream_closed(session):
                    self.end(session.session_id, "stream_broken", since=since)
        except Exception:
            logger.exception("ending the session of a closed KeepAlive stream failed")

    # ---------------------------------------------------------------- listing
    def live_sessions(self, call: Call, page_size: int = 0,
                      page_token: str = "") -> tuple[list[tuple[Session, float, int, int]], str]:
        """One page of live sessions, by id: (session, lease seconds left, its sequences, its blocks) each, and
        the token of the next page ("" after the last)."""
        after = paging.decode_token(page_token, "sessions")
        limit = paging.page_size(page_size, paging.SESSION_ROW_BYTES, self.max_message_bytes)
        manager = self.guard.manager
        with self.guard.lock:
            page, more = self.table.page(after, limit)
            rows = [(s, self.table.remaining_s(s), *_session_usage(manager, s.session_id)) for s in page]
        return rows, paging.encode_token("sessions", page[-1].session_id) if more else ""

    def sequences(self, call: Call, session_id: int = 0, page_size: int = 0,
                  page_token: str = "") -> tuple[list[tuple[int, int, int, int]], str]:
        """One page of live sequences (of ``session_id``, 0: all): (seq_id, session_id, num_tokens, num_blocks)
        each, and the token of the next page ("" after the last). Pages follow the internal ids (unique across
        tenants); each row shows the id its tenant names the sequence by (two tenants' rows may show the same)."""
        listing = f"sequences/{session_id}"
        after = paging.decode_token(page_token, listing)
        limit = paging.page_size(page_size, paging.SEQUENCE_ROW_BYTES, self.max_message_bytes)
        manager = self.guard.manager
        live: Collection[int]
        with self.guard.lock:
            if session_id:
                self.table.get(session_id)  # NOT_FOUND for a session that is not live
                live = manager.members.seqs_of_session.get(session_id, ())
            else:
                live = manager.index.seq_ids()
            ids = np.fromiter(live, dtype=np.uint64, count=len(live))
            if after >= 0:
                ids = ids[ids > np.uint64(after)]
            more = ids.size > limit
            if more:
                ids = np.partition(ids, limit - 1)[:limit]
            ids.sort()
            rows = []
            for seq_id in ids.tolist():
                num_tokens = manager.num_tokens(seq_id)
                rows.append((listings.named_id(manager, seq_id), manager.members.session_of_seq.get(seq_id, 0),
                             num_tokens, manager.tables.blocks_for(num_tokens)))
        return rows, paging.encode_token(listing, int(ids[-1])) if more else ""

    def gauges(self) -> SessionGauges:
        """For the metrics scrape: live sessions, and blocks still held by sequences of sessions that ended (the
        sweep frees them with the end, so this reads 0)."""
        manager = self.guard.manager
        with self.guard.lock:
            ended = [sid for sid in manager.members.seqs_of_session if sid not in self.table]
            usage = listings.session_usage(manager) if ended else {}
            ledger = manager.tenants
            tenants = tuple((name, ledger.num_blocks[t], ledger.num_sequences[t])
                            for t, name in enumerate(ledger.names) if name) if manager.tenancy else ()
            return SessionGauges(len(self.table), sum(usage[sid][1] for sid in ended), tenants)


def _session_usage(manager: KVCacheManager, session_id: int) -> tuple[int, int]:
    """(sequences, distinct blocks) of one session (``listings.session_usage`` for one session only)."""
    seq_ids = manager.members.seqs_of_session.get(session_id, ())
    if not seq_ids:
        return 0, 0
    blocks = np.concatenate([manager.block_table(seq_id) for seq_id in seq_ids])
    return len(seq_ids), int(np.unique(blocks).size)
