"""What the host tier's write-back does while holding the guard's lock (docs/prefix-caching.md, "The host tier"):
with the write-back thread's mode on, a write-back's copy is queued with the lock released, its events are built
there too, settling is O(completed) (oldest first, stopping at the first copy still in flight), a call settles
nothing unless it evicts a write-back's block, and a plan's scan resumes past the blocks it already covered. Structure, not timing."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvpool_server.offload import writeback as tier_writeback
from kvpool_server.offload.host_tier import HostTier
from kvpool_server.offload.events import host_stored_runs
from kvpool_server.core.kv_event_types import BlockStored
from kvpool_server.offload.tier_pool import CopyTicket
from kvpool_server.service.kvpool import KVPoolService
from kvpool_server.service.scope import CallScope
from tests.offload.test_service_host_tier import PROMPT_BLOCKS, check, free, make, prefill, prompt_of


@pytest.fixture
def threaded() -> Iterator[tuple[KVPoolService, CallScope]]:
    """A tiered service in the write-back thread's mode (offload on eviction off; the test drives the steps)."""
    svc, scope = make(64)
    assert svc.tier is not None
    svc.tier.tier.offload_on_evict = False  # what start_writeback sets
    try:
        yield svc, scope
    finally:
        svc.guard.pool.close()


def parked(svc: KVPoolService, scope: CallScope, num_prompts: int) -> None:
    for i in range(num_prompts):
        seq, _ = prefill(svc, scope, prompt_of(i), tag=i)
        free(svc, scope, seq)


def test_a_write_back_queues_its_copy_and_builds_its_events_with_the_lock_released(threaded) -> None:
    svc, scope = threaded
    assert svc.tier is not None
    parked(svc, scope, 2)
    memory, lock, held = svc.tier.memory, svc.guard.lock, []
    start = memory.start_offload

    def queued(pairs):  # type: ignore[no-untyped-def]
        held.append(lock.locked())
        return start(pairs)

    memory.start_offload = queued  # type: ignore[method-assign]
    events = svc.guard.events.log.pending  # the tier's events go there too (the pool cache's pending list)
    assert svc.tier.writeback_once(lock, 64) == 2 * PROMPT_BLOCKS
    assert held == [False]  # the copy was queued (on the GPU) or run (host backend) with no lock held
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    tier = svc.tier.tier
    hashes = [h for event in stored for h in event.block_hashes]
    assert len(hashes) == 2 * PROMPT_BLOCKS and len(stored) == 2  # a run of blocks that chain: one event, a prompt
    built = host_stored_runs([tier.entries[tier.slot_of_hash[h]] for h in reversed(hashes)])  # (eviction order)
    assert stored == built  # exactly the events a commit builds itself, of committed slots
    check(svc)


class Completion(CopyTicket):
    """A write-back whose copy completed (or not yet: ``landed``; or failed: not ``ok``), counting how often it is
    asked."""

    def __init__(self, landed: bool, ok: bool = True) -> None:
        super().__init__(ok)
        self.landed, self.asked = landed, 0

    def done(self) -> bool:
        self.asked += 1
        return self.landed


def test_settling_stops_at_the_first_write_back_in_flight_and_a_call_that_evicts_none_settles_nothing(threaded) -> None:
    svc, scope = threaded
    assert svc.tier is not None
    parked(svc, scope, 3)
    tier, cache = svc.tier.tier, svc.guard.manager.allocator.cache
    tickets = [Completion(True), Completion(True), Completion(False), Completion(True)]
    with svc.guard.lock:
        for ticket in tickets:
            pairs = tier_writeback.plan(tier, cache.evictable, cache.entries, 2)
            assert len(pairs) == 2
            svc.tier.writebacks.append((ticket, pairs))
        svc.tier.call(lambda: None)  # a mutation that evicts nothing: the write-backs are not even asked
        assert tier.num_written_back == 0 and [t.asked for t in tickets] == [0, 0, 0, 0]
        svc.tier.settle()  # what an eviction of a write-back's block runs first: the completed ones
        assert tier.num_written_back == 4 and [t.asked for t in tickets] == [1, 1, 1, 0]
        tickets[2].landed = True
        assert svc.tier.finish_writebacks(wait=False) == 4 and not svc.tier.writebacks
    assert tier.num_written_back == 8
    check(svc)


def test_a_settle_before_an_eviction_stops_at_a_failed_write_back(threaded) -> None:
    """A failed write-back is the write-back thread's to settle (its abort reports the hashes the pool no longer
    holds; after an eviction the eviction's own store plan reports them)."""
    svc, scope = threaded
    assert svc.tier is not None
    parked(svc, scope, 2)
    tier, cache = svc.tier.tier, svc.guard.manager.allocator.cache
    tickets = [Completion(True, ok=False), Completion(True)]
    with svc.guard.lock:
        for ticket in tickets:
            svc.tier.writebacks.append((ticket, tier_writeback.plan(tier, cache.evictable, cache.entries, 2)))
        svc.tier.settle()
        assert len(svc.tier.writebacks) == 2 and tier.num_offload_failed == 0
        assert svc.tier.finish_writebacks(wait=False) == 4  # the thread's settle: the failure, then the other
    assert tier.num_offload_failed == 2 and tier.num_written_back == 2
    check(svc)


class CountingEntries(dict):
    """The pool's cache entries, counting the lookups a plan makes."""

    lookups = 0

    def __getitem__(self, key):  # type: ignore[no-untyped-def]
        self.lookups += 1
        return super().__getitem__(key)


def test_a_plan_resumes_past_the_blocks_it_covered_and_rescans_after_a_block_is_taken_back(threaded) -> None:
    svc, scope = threaded
    assert svc.tier is not None
    parked(svc, scope, 3)
    tier, cache = svc.tier.tier, svc.guard.manager.allocator.cache
    n = cache.num_evictable
    with svc.guard.lock:
        entries = CountingEntries(cache.entries)
        first = tier_writeback.plan(tier, cache.evictable, entries, n)
        assert len(first) == n and tier.scan_skip == n
        entries.lookups = 0
        assert not len(tier_writeback.plan(tier, cache.evictable, entries, n))
        assert entries.lookups == 0  # nothing rescanned
        tier_writeback.finish(tier, first[:2], ok=False)  # a failed copy: those blocks are not in the tier any more
        again = tier_writeback.plan(tier, cache.evictable, entries, n)
        assert sorted(again[:, 0].tolist()) == sorted(first[:2, 0].tolist())  # found again: the hint was reset
        svc.tier.writebacks.append((Completion(True), first[2:]))
        svc.tier.writebacks.append((Completion(True), again))
        svc.tier.finish_writebacks(wait=True)
        block = next(iter(cache.evictable))
        cache.unpark(np.array([block]))  # a block taken back from inside the covered run (a prefix match) ...
        cache.park(np.array([block]))  # ... and parked again, at the LRU's end
        tier.scan_skip, tier.scan_mark = n, first[-1, 0]  # (as the last plan left them)
        assert tier.scan_start(cache.evictable) == 0  # the mark moved: the next plan scans from the LRU's start
    check(svc)


def test_a_hint_never_hides_a_block_the_tier_does_not_hold() -> None:
    """The core alone: a random walk of plans, evictions, failed write-backs and revivals; after each plan, every
    block of the skipped run is held (``check_invariants`` checks the hint)."""
    from collections import OrderedDict

    from kvpool_server.core import KVCacheManager
    from kvpool_server.core.block_hash import NONE_HASH, block_hash
    from kvpool_server.core.kv_event_types import CachedBlock
    from kvpool_server.core.types import EvictedBlocks

    rng = np.random.default_rng(0)
    tier = HostTier(KVCacheManager(num_blocks=1, block_size=1), 6)  # its pool's cache: this walk's LRU and index
    tier.offload_on_evict = False  # the write-back thread's mode: an eviction tears, never waits
    evictable: OrderedDict[int, None] = tier.cache.evictable
    entries: dict[int, CachedBlock] = {}
    index = tier.cache.block_of_hash
    next_block, inflight = 0, []
    for _ in range(400):
        op = rng.integers(0, 4)
        if op == 0 or not evictable:  # a block parked
            tokens = np.array([next_block], dtype=np.uint32)
            h = block_hash(NONE_HASH, tokens, b"", b"")
            entries[next_block] = CachedBlock(h, NONE_HASH, tokens, b"", b"")
            evictable[next_block] = None
            index[h] = next_block
            next_block += 1
        elif op == 1:  # an eviction of the LRU's oldest
            block = next(iter(evictable))
            del evictable[block]
            entry = entries.pop(block)
            del index[entry.block_hash]
            tier.prepare_store(EvictedBlocks([block], [entry]))
        elif op == 2:  # a revival from inside the LRU, parked again
            block = list(evictable)[rng.integers(0, len(evictable))]
            del evictable[block]
            evictable[block] = None
        else:  # a plan; the previous write-back settles (ok or failed)
            for pairs in inflight:
                tier_writeback.finish(tier, pairs, bool(rng.integers(0, 2)))
            inflight = [tier_writeback.plan(tier, evictable, entries, 2, max_scan=8)]
        tier.check_invariants()  # the hint's clause included
        if tier.scan_skip > 0 and tier.scan_start(evictable):
            held = set(tier.slot_of_hash) | set(tier.pending_hashes)
            for block in list(evictable)[: tier.scan_skip]:
                assert block in tier.inflight or entries[block].block_hash in held


def test_the_write_back_thread_keeps_a_prompt_whose_blocks_are_then_evicted() -> None:
    """End to end, the thread running (chunks queued with the lock released): a freed prompt is written back, its
    blocks evicted without a copy on the evicting calls' path, and it hits and reads back the same KV."""
    import time

    from tests.service.service_helpers import BLOCK_SIZE
    from tests.offload.test_service_host_tier import evict_everything, read

    svc, scope = make(64)
    try:
        assert svc.tier is not None
        svc.tier.start_writeback(svc.guard.lock, 2)  # chunks of at most 2 blocks in flight: several steps a prompt
        full = PROMPT_BLOCKS * BLOCK_SIZE
        seq, _ = prefill(svc, scope, prompt_of(0), tag=0)
        first_kv = read(svc, scope, seq, full)
        free(svc, scope, seq)
        deadline = time.monotonic() + 30  # only so that a broken build fails instead of hanging
        while svc.tier.tier.num_written_back < PROMPT_BLOCKS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert svc.tier.tier.num_written_back >= PROMPT_BLOCKS
        svc.tier.stop()  # nothing in flight from here: the evictions below find the blocks committed
        evict_everything(svc, scope)
        seq, cached = prefill(svc, scope, prompt_of(0), tag=99)
        assert cached == full and read(svc, scope, seq, full) == first_kv
        check(svc)
    finally:
        if svc.tier is not None:
            svc.tier.stop()
        svc.guard.pool.close()


def test_a_write_back_whose_copy_cannot_start_is_aborted_and_the_step_idles(threaded) -> None:
    svc, scope = threaded
    assert svc.tier is not None
    parked(svc, scope, 1)
    tier = svc.tier.tier
    free_before = len(tier.free)

    def refuse(pairs):  # type: ignore[no-untyped-def]
        raise RuntimeError("the host tier is closed")

    svc.tier.memory.start_offload = refuse  # type: ignore[method-assign]
    assert svc.tier.writeback_step(svc.guard.lock, 64) == 0  # 0: the thread waits idle_s before trying again
    assert not svc.tier.writebacks and not tier.inflight and len(tier.free) == free_before
    assert tier.num_offload_failed == PROMPT_BLOCKS
    check(svc)
