"""TierCopies: the host tier's driver -- runs the tier's plans (stores, loads, write-backs) in the order the core's
plans need them, none of them (but the rare waits below) while the guard's lock is held.

    plan = tier.append(lambda: manager.append(...))   # under the lock: the core's call, its plan's stores
    answer = tier.call(apply)                          # under the lock: any other mutation (apply, its stores)
    restoring = tier.start_restore(lock, fence, hashes)  # a register: staged (and its stores run), copied unlocked
    ... under the lock, in the register's hold: tier.finish_restore(restoring), then the core's register ...

The order is what keeps KV right (docs/prefix-caching.md, "The host tier"):
- an evicted block is copied out *before* anything writes into it: the core's plan names the blocks its call
  evicted (``AppendPlan.evicted``), ``HostTier.prepare_store`` turns them into a ``StorePlan`` and ``run_stores``
  runs it right after the core's call and before the plan's clearing and copy-on-write copies
  (``KVPoolService.append``), once a call; the copy has completed when ``offload_blocks`` returns; only then is the
  slot committed (matchable). A copy that raises aborts its slots.
- a restore is staged under the lock (fresh pool blocks held by nobody's table and not in the prefix cache, its host
  slots pinned), copied with the lock released (other calls go on: a decode step never waits behind a restore's
  megabytes), and settled under the lock again, in the same hold as the register that adopts it
  (``finish_restore``): its blocks enter the prefix cache only after ``restore_blocks`` returned; one that raises
  fences its slots and leaves the fresh blocks free: the register finds a miss there. Nobody else can see the
  blocks half-copied: they are not matchable, no other sequence holds them, and a concurrent register of the same
  prompt stops its own restore at a pinned slot (a miss).
- a restore's own allocation may evict: those stores (``StagedRestore.stores``) run first (they read the blocks the
  restore then writes).

Write-back (``start_writeback``, ``--host-tier-writeback-blocks``): a background thread copies the pool's
evictable blocks next in line into the tier ahead of need, at most that many blocks in flight, in chunks of at most
``WRITEBACK_CHUNK_BLOCKS`` (``writeback_step``): one short hold of the lock settles the chunks whose copy completed
(oldest first, stopping at the first in flight) and plans the next chunk (``writeback.plan``); with the lock
released it queues the chunk's copy and then builds its events, or waits for the oldest copy. An allocation then evicts
blocks whose content the tier already holds, and its call copies nothing. With the write-back on, an eviction the
write-back did not reach first is dropped from the tier (``HostTier.offload_on_evict`` off: a later miss) rather
than copied under the lock, and an eviction of a block whose write-back is in flight (queued or not yet) tears that
slot (aborted when the chunk settles) rather than wait; a call that evicts such a block first commits the chunks
whose copy completed (``store_plan``, ``settle``), so that few are torn, and a call that evicts none does nothing
of the write-back's: its commits are the write-back thread's, in its own holds. With offload on eviction
(write-back driven by hand), a store plan waits for such a copy instead (``StorePlan.wait``). The events of a
write-back (BlockStored "CPU", a BlockRemoved of a dropped slot) are published by the thread at the end of its
hold (``start_writeback``'s ``publish``; without it, with the next call's batch). Without the write-back (0), offloads run
on eviction and hold the lock across their copy: with 2 MiB blocks ~50 us a block at host-link speed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TypeVar

import numpy as np

from kvpool_server.core.types import AppendPlan, EvictedBlocks
from kvpool_server.log_limits import RateLimitedLog
from kvpool_server.offload import restore, writeback
from kvpool_server.offload.events import host_stored_runs
from kvpool_server.offload.host_tier import NO_PAIRS, HostTier, StorePlan
from kvpool_server.offload.restore import StagedRestore
from kvpool_server.offload.tier_pool import CopyTicket, TierPool

A = TypeVar("A")
logger = logging.getLogger(__name__)
# A copy that fails may fail at the rate of the calls (every offload): one line per kind per 10 s, with the count
# of those held back (the failures are counted in Stats' host_tier all the same).
failures_log = RateLimitedLog(logger)
FAILURE_BACKOFF_S = 1.0  # the write-back thread idles this long after a write-back failed (not a busy retry loop)
# The write-back thread plans at most this many blocks a lock hold: with 2 MiB blocks, a
# chunk's copy is ~0.3 ms at host-link speed. On the H200 (bench_tier --sections append, four runs each) 8 against
# 32 cut the thread's hold p99 from ~320 to 100-280 us and the decode step's p99 ratio from ~2.2x to ~1.3x (median).
WRITEBACK_CHUNK_BLOCKS = 8


class Restoring:
    """A restore staged and copied (``ok``: the copy completed), to settle with ``TierCopies.finish_restore``."""

    def __init__(self, staged: StagedRestore) -> None:
        self.staged = staged
        self.ok = False
        self.finished = False


class TierCopies:
    """The host tier's bookkeeping (``tier``, a ``HostTier``) and its memory (``memory``), driven together."""

    def __init__(self, tier: HostTier, memory: TierPool) -> None:
        self.tier: HostTier = tier
        self.cache = tier.cache  # the pool's prefix cache (its evictable LRU, for the write-back)
        self.memory = memory
        # In flight, oldest first: (ticket, pairs[, its slots' BlockStored events and hashes, read ahead]); appended
        # by the write-back's thread (``_queue``), settled from the front under the lock (``finish_writebacks``).
        self.writebacks: list[tuple] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_failed_writebacks = 0  # write-back chunks that failed (or could not start), since start
        self._publish: Callable[[], None] | None = None  # the write-back thread's: publish its holds' events

    def call(self, apply: Callable[[], A]) -> A:
        """A mutation's core call, under the guard's lock: ``apply()``, then the stores of its evictions
        (``store_plan``). Evictions of a call that raised (the core raises before it changes anything: none) are
        stored all the same. A call that evicts nothing does nothing of the tier's."""
        try:
            return apply()
        finally:
            if self.cache.evicted_ids:
                self.run_stores(self.store_plan(self.cache.take_evicted()))

    def append(self, append: Callable[[], AppendPlan]) -> AppendPlan:
        """An append's core call (``call``), then the stores its plan's evictions need (``plan.evicted``), run
        before the caller's device work (the plan's clearing and copy-on-write copies) writes into them."""
        plan = self.call(append)
        if plan.evicted.block_ids:
            self.run_stores(self.store_plan(plan.evicted))
        return plan

    def store_plan(self, evicted: EvictedBlocks) -> StorePlan:
        """``HostTier.prepare_store`` of a call's evictions, right after the core's call (the evicted blocks
        not written yet): when one of them is a write-back's, the completed write-backs are settled first
        (``settle``), so that a block whose copy completed is kept (committed), not torn. O(evicted) otherwise."""
        if self.writebacks and not self.tier.inflight.keys().isdisjoint(evicted.block_ids):
            self.settle()
        return self.tier.prepare_store(evicted)

    def run_stores(self, stores: StorePlan) -> None:
        """Run a store plan: first, if the call evicted a block a write-back is copying, wait for that copy; then
        the offloads, committed when they completed, aborted when the copy raised."""
        if stores.wait:
            self.finish_writebacks(wait=True)
        if not len(stores.pairs):
            return
        slots = stores.pairs[:, 1].tolist()
        try:
            self.memory.offload_blocks(stores.pairs)
        except Exception as exc:
            failures_log.warning_of("offload", "host tier: an offload of %d blocks failed (%s): they are dropped",
                                 len(slots), exc)
            self.tier.abort(slots)
            return
        self.tier.commit(slots)

    def start_restore(self, lock: AbstractContextManager, fence: Callable[[], None],
                      hashes: list[bytes]) -> Restoring | None:
        """Bring a prompt's host-tier blocks back into the pool, for a register: stage under ``lock`` (the guard's;
        after ``fence()``, the caller's session fenced) and run the staging's stores, copy with the lock released,
        and return what ``finish_restore`` settles -- under the lock, in the hold of the register whose match then
        finds the blocks. None: nothing to restore. ``hashes``: the prompt's ``prefix.prompt_hashes``, computed by
        the caller with the lock free."""
        with lock:
            fence()
            self.settle()  # (the staging's own evictions are planned inside ``stage``)
            staged = restore.stage(self.tier, hashes)
            if staged is not None:  # the staging's allocation may have evicted: read before the loads write
                self.run_stores(staged.stores)
        if staged is None:
            return None
        restoring = Restoring(staged)
        try:
            self.memory.restore_blocks(staged.pairs)  # the lock is free: other calls run meanwhile
            restoring.ok = True
        except Exception as exc:
            failures_log.warning_of("restore", "host tier: a restore of %d blocks failed (%s): a miss",
                                 len(staged.pairs), exc)
        except BaseException:  # interrupted: nothing may stay staged
            with lock:
                self.finish_restore(restoring)
            raise
        return restoring

    def finish_restore(self, restoring: Restoring | None) -> int:
        """Settle a restore (under the guard's lock; once, later calls do nothing): its blocks enter the prefix
        cache when the copy completed, else its slots are fenced. Returns how many blocks were restored."""
        if restoring is None or restoring.finished:
            return 0
        restoring.finished = True
        restore.finish(self.tier, restoring.staged, restoring.ok)
        return len(restoring.staged.pairs) if restoring.ok else 0

    # ------------------------------------------------------------------ write-back
    def start_writeback(self, lock: AbstractContextManager, max_blocks: int, idle_s: float = 0.02,
                        publish: Callable[[], None] | None = None) -> None:
        """Start the background write-back thread (``lock``: the guard's; ``max_blocks`` a batch; ``publish``: the
        guard's event publishing, which the thread calls at the end of its holds, so that its events are a batch of
        their own instead of the next call's work). From now on an eviction the write-back did not reach first is
        dropped from the tier, never copied under the lock."""
        self._publish = publish
        with lock:
            self.tier.offload_on_evict = False
        self._thread = threading.Thread(target=self._writeback_loop, args=(lock, max_blocks, idle_s),
                                        name="kvpool-tier-writeback", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def writeback_once(self, lock: AbstractContextManager, max_blocks: int) -> int:
        """One write-back batch: plan it under ``lock``, queue its copy, wait for it outside, commit it under
        ``lock``. Returns its blocks (0: nothing to write back). With offload on eviction (no thread) the copy is
        queued under the lock (an eviction waits for it: it must be in ``writebacks`` first); else outside it."""
        with lock:
            self.finish_writebacks(wait=False)
            if self.writebacks or self.memory.closed:
                return 0
            pairs = writeback.plan(self.tier, self.cache.evictable, self.cache.entries, max_blocks)
            if not len(pairs):
                return 0
            locked = self.tier.offload_on_evict
            ticket = self._queue(pairs, None) if locked else None
        if not locked:
            ticket = self._queue(pairs, lock)
        if ticket is None:
            return 0
        ticket.wait()  # outside the lock: calls go on while the copy engines work
        with lock:
            self.finish_writebacks(wait=False)
        return len(pairs)

    def writeback_step(self, lock: AbstractContextManager, max_blocks: int) -> int:
        """The write-back thread's step. Under ``lock``, one short hold: settle the write-backs that completed and,
        while fewer than ``max_blocks`` blocks are in flight, plan a chunk of at most ``WRITEBACK_CHUNK_BLOCKS``
        (scanning at most ``8 * max_blocks`` of the LRU). Outside it: queue the chunk's copy (its events built
        after it), or else wait for the oldest copy in flight. Returns the blocks planned or settled (0: idle, or the
        copy could not start)."""
        with lock:
            settled = self.finish_writebacks(wait=False)
            in_flight = sum(len(w[1]) for w in self.writebacks)
            pairs = NO_PAIRS
            if in_flight < max_blocks and not self.memory.closed:
                cache = self.cache
                pairs = writeback.plan(self.tier, cache.evictable, cache.entries,
                                            min(WRITEBACK_CHUNK_BLOCKS, max_blocks - in_flight), 8 * max_blocks)
            if self._publish is not None:  # this hold's commits and drops: a batch of their own
                self._publish()
        if len(pairs):  # a copy that could not start: idle a while (0), as with nothing to do
            return len(pairs) if self._queue(pairs, lock) is not None else 0
        for ticket, *_ in self.writebacks[:1]:  # the oldest (a settle under the lock may take it meanwhile: harmless)
            ticket.wait()
            return 1
        return settled

    def _queue(self, pairs: np.ndarray, lock: AbstractContextManager | None) -> CopyTicket | None:
        """Queue the write-back copy of planned ``pairs`` (under the guard's lock when ``lock`` is None, else with
        it released: then an eviction of one of its blocks tears the slot, as before the copy is queued) and add
        it to ``writebacks`` (appended last: only the write-back's thread appends; settles take from the front,
        under the lock). Its slots' BlockStored events are built here and their hashes read, for the commit --
        after the copy is queued: the copy's calls release the GIL, and a serving call waiting on the lock this
        thread has just released gets it at the first of them rather than after this Python (the events and
        hashes of the slots, pending until the chunk settles, do not change meanwhile). Returns its ticket; None:
        the copy could not start, the slots are aborted (under ``lock``)."""
        tier = self.tier
        try:
            ticket = self.memory.start_offload(pairs)
        except Exception as exc:  # closed, or the copy could not be queued
            failures_log.warning_of("write-back start", "host tier: a write-back of %d blocks could not start (%s)",
                                 len(pairs), exc)
            self.num_failed_writebacks += 1
            if lock is None:
                writeback.finish(tier, pairs, ok=False)
            else:
                with lock:
                    writeback.finish(tier, pairs, ok=False)
            return None
        slots = pairs[:, 1].tolist()
        hashes = list(map(tier.entries.hash_of, slots))  # for the commit (read here, off the lock)
        stored = None if tier.cache.events is None else host_stored_runs([tier.entries[s] for s in slots])
        self.writebacks.append((ticket, pairs, stored, hashes))
        return ticket

    def settle(self) -> None:
        """Commit the write-backs whose copy completed (under the lock), oldest first, stopping at the first in
        flight or failed (a failure is the write-back thread's to settle): before an eviction of a block one of them
        copies (``store_plan``) or a restore's staging, so that the eviction finds its block in the tier (not torn:
        a torn slot is lost). The write-back thread settles the rest; a call that evicts no write-back's block
        settles nothing."""
        if self.writebacks:
            self.finish_writebacks(wait=False, completed_only=True)

    def finish_writebacks(self, wait: bool, completed_only: bool = False) -> int:
        """Settle the write-backs that completed, oldest first, stopping at the first still in flight (copies
        complete in the order queued: one stream), or all of them, waiting, with ``wait``; under the lock.
        ``completed_only``: stop at the first that failed too. O(settled), not O(queued). Returns the blocks
        settled."""
        settled, writebacks = 0, self.writebacks
        while writebacks:
            entry = writebacks[0]
            ticket, pairs = entry[0], entry[1]
            if not wait and not ticket.done():
                break
            if completed_only and not ticket.wait():  # done: no wait; failed: left for the write-back's thread
                break
            ok = self.memory.settle_writeback(ticket)  # waits; its bytes and seconds counted once
            if not ok:
                failures_log.warning_of("write-back", "host tier: a write-back of %d blocks failed: they are not kept",
                                     len(pairs))
                self.num_failed_writebacks += 1
            writeback.finish(self.tier, pairs, ok, *entry[2:4])
            del writebacks[0]
            settled += len(pairs)
        return settled

    def _writeback_loop(self, lock: AbstractContextManager, max_blocks: int, idle_s: float) -> None:
        while not self._stop.is_set() and not self.memory.closed:
            failed = self.num_failed_writebacks
            try:
                moved = self.writeback_step(lock, max_blocks)
            except Exception:
                logger.exception("host tier: the write-back thread failed; it stops")
                return
            if self.num_failed_writebacks != failed:  # a failing tier: retry the blocks later, not at once
                self._stop.wait(FAILURE_BACKOFF_S)
            elif not moved:
                self._stop.wait(idle_s)

    def make_ready(self, num_ready: int) -> None:
        """More of the tier's memory is there (called under the guard's lock)."""
        self.tier.make_ready(num_ready)
