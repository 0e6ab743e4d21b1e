"""CoreGuard: the core, the pool and the session table behind one lock, and the one path every mutation takes.

    answer = guard.mutate(caller, session_id, request_id, (what identifies the request...), apply)

under the lock, in this order:

1. **Fencing.** A call that names a session is served only while that session is live and the caller's; the call
   renews its lease. A call from a session that ended (closed, lease expired, keep-alive broken, or one of an
   earlier server start) is refused with NOT_FOUND and a ``kvpool-error`` reason before it changes anything: a
   stopped process that wakes up after its session was reclaimed cannot write into blocks that are someone
   else's now.
2. **Safe retries.** A call with a ``request_id`` is looked up in the ``ReplyCache`` (keyed by tenant and session):
   a repeat gets the first answer and is applied once.
3. ``apply()``: the core's call and the pool's work (copy-on-write copies, clearing blocks that change hands; with a
   host tier, its stores first: ``offload.TierCopies.call``, which the service's ``apply`` goes through).
4. **KV events**: whatever the mutation sealed or evicted is published as one batch (``EventFeed.publish``), so a
   subscriber sees every locked mutation's events together, whichever RPC or transport made it.

One ``threading.Lock`` covers the manager *and* the pool: calls run on the server's event loop thread, and the
lock keeps the other threads -- the metrics scrape, big copies on copy threads, shutdown closing the pool -- from
seeing half a call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from kvpool_server.core import KVCacheManager
from kvpool_server.core.sessions import SessionTable
from kvpool_server.device.protocol import Pool
from kvpool_server.service.auth import Identity
from kvpool_server.service.events import EventFeed
from kvpool_server.service.replay import ReplyCache, fingerprint

A = TypeVar("A")


class CoreGuard:
    def __init__(self, manager: KVCacheManager, pool: Pool, sessions: SessionTable, replies: ReplyCache,
                 events: EventFeed) -> None:
        self.manager = manager
        self.pool = pool
        self.sessions = sessions
        self.replies = replies
        self.events = events
        self.lock = threading.Lock()

    def fence(self, caller: Identity, session_id: int) -> None:
        """Step 1 alone (under the lock): a write is idempotent, so it is fenced but never replayed."""
        if session_id:
            self.sessions.renew(session_id, caller.tenant_id)

    def mutate(self, caller: Identity, session_id: int, request_id: int, request: tuple,
               apply: Callable[[], A], renew: bool = True) -> A:
        """Fence, replay or ``apply()``, publish events -- see the module docstring. ``request`` holds what
        identifies the request (for its fingerprint: the same request id with other arguments is refused).
        ``renew`` False: the call fenced (and renewed) its session in an earlier hold (a register's restore):
        the session must still be live, its lease is not renewed again."""
        tenant = caller.tenant_id
        # before the lock: per-token work (a 32k-token prompt's fingerprint is ~0.3 ms) holds up no other call
        request_fingerprint = fingerprint(*request) if request_id else b""
        with self.lock:
            if session_id:
                (self.sessions.renew if renew else self.sessions.get)(session_id, tenant)
            if request_id:
                replay = self.replies.lookup(tenant or 0, session_id, request_id, request_fingerprint)
                if replay is not None:
                    return replay
            try:
                answer = apply()
            finally:
                if self.events.log.pending:
                    self.events.publish()
            if request_id:
                self.replies.store(tenant or 0, session_id, request_id, request_fingerprint, answer)
            return answer
