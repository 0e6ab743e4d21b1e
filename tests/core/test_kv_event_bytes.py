"""The KV event log is bounded in bytes (issue 20, item 7): a frontend sealing long prompts in a loop grew a server
from 72 MB to 3.36 GB while the log held its 10,000 batches. The log's accounted bytes, and what tracemalloc sees
it hold, stay under ``max_bytes``; unbounded, the same loop goes far past it."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from kvpool_server.core import KVCacheManager, event_records
from kvpool_server.core.kv_events import DEFAULT_EVENT_LOG_BYTES, KVEventLog, batch_bytes

from .event_consumer import EventConsumer, cache_index

BS = 16
PROMPT = 2048  # tokens: 128 blocks a prompt
BOUND = 1 << 20


def seal_prompts(manager: KVCacheManager, log: KVEventLog, num_prompts: int, seed: int) -> None:
    """A frontend's loop: a new long prompt, sealed by the next append, published after each call, freed."""
    rng = np.random.default_rng(seed)
    for _ in range(num_prompts):
        seq = manager.register()
        manager.append(seq, PROMPT, token_ids=rng.integers(0, 1 << 31, PROMPT))
        log.publish()
        manager.append(seq, 1, token_ids=[0])  # seals the prompt's blocks
        log.publish()
        manager.free(seq)


def held_by_log(log: KVEventLog) -> int:
    """What tracemalloc sees the log's batches hold: the memory that goes when they are dropped."""
    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    log.batches.clear()
    log.newest = None
    gc.collect()
    return before - tracemalloc.get_traced_memory()[0]


@pytest.mark.parametrize("max_bytes", [BOUND, 1 << 62])
def test_sealing_long_prompts_in_a_loop_stays_under_the_byte_bound(max_bytes: int) -> None:
    manager = KVCacheManager(num_blocks=2 * PROMPT // BS + 8, block_size=BS)  # room for one prompt cached
    log = KVEventLog(epoch=1, max_bytes=max_bytes)  # 10,000 batches: the count bound never bites here
    log.attach(manager.allocator.cache)
    seal_prompts(manager, log, 4, seed=1)  # the cache full and turning over: the manager's own memory is steady
    tracemalloc.start()
    try:
        gc.collect()
        start = tracemalloc.get_traced_memory()[0]
        seal_prompts(manager, log, 200, seed=2)
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - start
        accounted = log.num_bytes
        assert accounted == sum(batch_bytes(event_records.unpack(b)) for b in log.batches)
        held = held_by_log(log)
    finally:
        tracemalloc.stop()
    assert held <= accounted  # the estimate does not undercount (hashes shared with the cache cost it less)
    if max_bytes == BOUND:
        assert accounted <= BOUND and growth <= BOUND * 1.1
        assert log.num_dropped > 0 and log.since(1) is None
    else:  # what the bound prevents: without it the same loop holds several times as much
        assert accounted > 4 * BOUND and growth > 3 * BOUND and log.num_dropped == 0


def test_the_default_bound_is_64_mib() -> None:
    assert DEFAULT_EVENT_LOG_BYTES == 64 << 20 and KVEventLog(epoch=1).max_bytes == DEFAULT_EVENT_LOG_BYTES


def test_a_call_whose_events_outgrow_the_bound_loses_its_batch_and_subscribers_resnapshot() -> None:
    """The pending events of one call are bounded too: past ``max_bytes`` they are dropped, and the log sends every
    subscriber (caught up or behind) to a snapshot, which is the cache as it is."""
    manager = KVCacheManager(num_blocks=4096, block_size=BS)
    log = KVEventLog(epoch=1, max_bytes=64 << 10)
    log.attach(manager.allocator.cache)
    caught_up = EventConsumer()
    seq = manager.register()
    manager.append(seq, BS + 1, token_ids=list(range(BS + 1)))
    manager.append(seq, 1, token_ids=[0])  # one block sealed: batch 1
    caught_up.apply(log.publish())
    rng = np.random.default_rng(3)
    long = manager.register()
    manager.append(long, 8 * PROMPT, token_ids=rng.integers(0, 1 << 31, 8 * PROMPT))
    manager.append(long, 1, token_ids=[0])  # seals 1,024 blocks in one call: ~0.5 MB of pending events
    assert log.pending.lost and log.pending.num_bytes <= log.max_bytes
    dropped = log.num_dropped
    log.publish()  # may publish, as batch 3, the call's events after the loss
    assert log.num_dropped == dropped + 2  # the buffered batch 1 and the lost batch 2
    assert log.since(caught_up.seq + 1) is None and log.since(1) is None
    caught_up.apply(log.snapshot(manager.allocator.cache))
    assert caught_up.blocks == cache_index(manager.allocator.cache) and len(caught_up.blocks) == 1 + 8 * PROMPT // BS
    manager.append(long, BS, token_ids=list(range(BS)))  # the next call's events: batch 3, in order after it
    manager.append(long, 1, token_ids=[0])
    batch = log.publish()
    assert batch is not None and batch.seq == caught_up.seq + 1 and log.since(caught_up.seq + 1) == [batch]
    caught_up.apply(batch)
    assert caught_up.blocks == cache_index(manager.allocator.cache)
    manager.check_invariants()
