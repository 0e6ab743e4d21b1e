"""A Free too big for one lock hold: detached at once (all or none), its blocks released in bounded chunks.

A Free of a 4,096-fork family of a 32,768-token sequence drops 8 M block references: tens of ms in one piece,
during which the event loop serves nothing (Health, Stats, every decode step wait). So the Free is split:

1. **One hold, all or none** (``CoreGuard.mutate``): the core checks every id (``KVCacheManager.detach``: unknown,
   another tenant's, repeated: the call fails and nothing changes), then detaches them: from here on every call
   naming them gets NOT_FOUND and no session holds them -- the Free has taken effect for everyone but the pool's
   free-block count. Their rows keep their blocks (``manager.detached_rows``), so nothing else can see or take
   them half-released.
2. **Chunks** (``plan_chunks``): at most ``MAX_REFS_PER_HOLD`` block references and ``MAX_ROWS_PER_HOLD`` rows
   each, released one lock hold apiece (``KVCacheManager.release_detached``) on the event loop, which serves other
   calls between chunks. A copy thread (``Offload``) drives them and waits for each; the reply (blocks freed) is
   sent after the last one.

A Free small enough (one chunk) is released in the first hold, as before. A retry with the same ``request_id``
gets the same ``Freeing`` from the reply cache and waits for it to finish (``offload``). Once detached, the rows
are always released, even if the caller goes away (the copy thread's work is shielded from cancellation).

Invariant: every row of ``chunks`` is in ``manager.detached_rows`` until its chunk is released; ``num_freed`` is
the blocks freed by the chunks released so far; ``done`` is set once they all are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np

from kvpool_server.service.guard import CoreGuard
from kvpool_server.service.offload import Offload

MAX_REFS_PER_HOLD = 1 << 18  # block references released in one lock hold: ~2-3 ms on this 2-core machine
MAX_ROWS_PER_HOLD = 1024  # sequences released in one lock hold (their per-row work: ledger, token chains)


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
    """A detached Free's chunks of rows, released one lock hold each (see the module docstring)."""

    def __init__(self, chunks: list[list[int]]) -> None:
        self.chunks = chunks
        self.num_freed = 0
        self.done = threading.Event()
        self._started = False

    def offload(self, guard: CoreGuard, loop: asyncio.AbstractEventLoop) -> Offload:
        """The Free's answer: an Offload whose work releases the chunks (the first time) or waits for them (a
        retry of the same request) and returns the blocks freed."""
        if self._started:
            return Offload(self._wait)
        self._started = True
        return Offload(lambda: self._release_all(guard, loop))

    def _wait(self) -> int:
        self.done.wait()
        return self.num_freed

    def _release_all(self, guard: CoreGuard, loop: asyncio.AbstractEventLoop) -> int:
        """On a copy thread: each chunk on the loop, one lock hold each, waiting for it before the next."""
        try:
            for chunk in self.chunks:
                released: concurrent.futures.Future[int] = concurrent.futures.Future()
                loop.call_soon_threadsafe(release_chunk, guard, chunk, released)
                self.num_freed += released.result()
        finally:
            self.done.set()
        return self.num_freed


def release_chunk(guard: CoreGuard, rows: list[int], answer: concurrent.futures.Future[int]) -> None:
    """On the loop: release detached ``rows`` under one lock hold, publish what it evicted or stored."""
    try:
        with guard.lock:
            num_freed = guard.manager.release_detached(rows)
            if guard.events.log.pending:
                guard.events.publish()
    except BaseException as exc:  # pragma: no cover - the core does not raise here; never leave the waiter hanging
        answer.set_exception(exc)
        raise
    answer.set_result(num_freed)
