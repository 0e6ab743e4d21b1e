"""A Free too big for one lock hold: detached at once (all or none), its blocks released in bounded chunks.

A Free of a 4,096-fork family of a 32,768-token sequence drops 8 M block references: tens of ms in one piece,
during which the event loop serves nothing (Health, Stats, every decode step wait). So the Free is split:

1. **One hold, all or none** (``CoreGuard.mutate``): the core checks every id (``KVCacheManager.detach``: unknown,
   another tenant's, repeated: the call fails and nothing changes), then detaches them: from here on every call
   naming them gets NOT_FOUND and no session holds them -- the Free has taken effect for everyone but the pool's
   free-block count. Their rows keep their blocks (``manager.detached_rows``), so nothing else can see or take
   them half-released.
2. **Chunks** (``plan_chunks``): at most ``MAX_REFS_PER_HOLD`` block references and ``MAX_ROWS_PER_HOLD`` rows
   each, released one lock hold apiece (``KVCacheManager.release_detached``), each in its own callback on the
   event loop (``loop.call_soon``), which polls and serves other calls between them. The Free's reply (blocks
   freed) waits for the last one: an ``Offload`` whose work waits on a copy thread (``Freeing.wait``).

A Free small enough (one chunk) is released in the first hold, as before. A retry with the same ``request_id``
gets the same ``Freeing`` from the reply cache and waits for it too. Once detached, the rows are released whatever
the caller does (the chunks do not belong to the call). The end of a session (CloseSession, an expired lease, a
broken keep-alive) frees its sequences the same way (``service.sessions``).

Invariant: every row of ``chunks[_next:]`` is in ``manager.detached_rows``; ``num_freed`` is the blocks freed by
``chunks[:_next]``; ``done`` is set once they all are released (``chunks`` is then emptied: a Freeing kept in the
reply cache for retries holds its answer only).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from kvpool_server.service.guard import CoreGuard

MAX_REFS_PER_HOLD = 1 << 18  # block references released in one lock hold: ~2-3 ms on this 2-core machine
MAX_ROWS_PER_HOLD = 1024  # sequences released in one lock hold (their per-row work: ledger, token chains)
WAIT_POLL_S = 0.1  # how often a waiting Free checks that the loop still runs its chunks


def plan_chunks(rows: list[int], refs: np.ndarray, max_refs: int = MAX_REFS_PER_HOLD,
                max_rows: int = MAX_ROWS_PER_HOLD) -> list[list[int]]:
    """Split ``rows`` (holding ``refs[i]`` block references each) in order into chunks of at most ``max_refs``
    references (or one row, if that row alone holds more) and at most ``max_rows`` rows."""
    ends = np.cumsum(refs, dtype=np.int64)
    chunks, start, done = [], 0, 0
    while start < len(rows):
        stop = int(np.searchsorted(ends, done + max_refs, side="right"))  # rows whose end fits
        stop = min(max(stop, start + 1), start + max_rows, len(rows))
        chunks.append(rows[start:stop])
        done, start = int(ends[stop - 1]), stop
    return chunks


class Freeing:
    """A detached Free's chunks of rows, released one lock hold each, one loop callback each (see the module
    docstring). ``then`` callbacks run on the loop once the last chunk is released, with the blocks freed."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks
        self.num_freed = 0
        self.done = threading.Event()
        self._then: list[Callable[[int], None]] = []
        self._next = 0  # the next chunk to release
        self._guard: CoreGuard
        self._loop: asyncio.AbstractEventLoop

    def start(self, guard: CoreGuard) -> Freeing:
        """Under the lock, on the event loop: release the chunks from the loop's next turn on, each in a later turn
        than the one before. Off any loop (a caller on another thread), all of them now, in this hold: never
        left detached."""
        self._guard = guard
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            while self._next < len(self.chunks):
                self.num_freed += guard.manager.release_detached(self.chunks[self._next])
                self._next += 1
            self._finish()
            return self
        self._loop.call_soon(self._release_next)
        return self

    def then(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(blocks freed)`` once every chunk is released (or now, if they are)."""
        if self.done.is_set():
            callback(self.num_freed)
        else:
            self._then.append(callback)

    def wait(self) -> int:
        """Block (a copy thread: an ``Offload``'s work) until every chunk is released; the blocks freed. Should the
        loop be closed first (shutdown), the rest is released here, so no copy thread waits forever."""
        while not self.done.wait(WAIT_POLL_S):
            if self._loop.is_closed():  # no callback runs any more: nothing races with this
                while not self.done.is_set():
                    self._release_next(publish=False)
        return self.num_freed

    def _release_next(self, publish: bool = True) -> None:
        guard, chunk = self._guard, self.chunks[self._next]
        self._next += 1
        with guard.lock:
            self.num_freed += guard.manager.release_detached(chunk)
            if publish and guard.events.log.pending:
                guard.events.publish()  # on the loop thread only
        if self._next < len(self.chunks):
            if publish:
                self._loop.call_soon(self._release_next)  # the loop polls and serves others first
            return
        self._finish()

    def _finish(self) -> None:
        self.chunks = []  # a retry's reply cache entry keeps only the answer
        self.done.set()
        for callback in self._then:
            callback(self.num_freed)


def may_chunk(manager: Any, n_ids: int) -> bool:
    """A Free of ``n_ids`` sequences may take more than one lock hold (each holds at most ``max_seq_len``
    tokens' blocks): a transport then makes it on the event loop, whose callbacks release its chunks."""
    most_blocks = -(-manager.max_seq_len // manager.block_size)
    return n_ids > MAX_ROWS_PER_HOLD or n_ids * most_blocks > MAX_REFS_PER_HOLD


def free_rows(guard: CoreGuard, rows: list[int]) -> int | Freeing:
    """Under the lock, after ``manager.detach``: release ``rows`` now if they fit one hold (the blocks freed), else
    return a ``Freeing`` of them, to be started once the lock is let go (``Freeing.start``)."""
    tables = guard.manager.tables
    chunks = plan_chunks(rows, tables.by_length.num_blocks.take(tables.num_tokens.take(rows)))
    return guard.manager.release_detached(rows) if len(chunks) == 1 else Freeing(chunks)
