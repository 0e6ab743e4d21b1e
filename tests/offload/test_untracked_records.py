"""What a warm prefix cache leaves for Python's cyclic garbage collector to walk (docs/architecture.md, "The garbage
collector"): nothing per cached block -- not the pool cache's records, not the host tier's, not the KV event log's
buffered batches -- and, after ``gc_policy.apply``, not the lists that hold them either."""

from __future__ import annotations

import gc
from collections import Counter

import numpy as np

from kvpool_server import gc_policy
from kvpool_server.core.kv_events import KVEventLog
from tests.offload.tiered import Tiered

BS = 16
NUM_BLOCKS = 2048


def warm(t: Tiered, log: KVEventLog, rounds: int, seed: int) -> None:
    """Rounds of 64 sequences registered with distinct prompts, decoded with token ids and freed: their blocks
    cached, evicted into the host tier (committed) and replaced; a batch of events published per call."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        prompts = rng.integers(1, 2**31, size=(64, 2 * BS), dtype=np.uint32)
        ids = [t.manager.register(prompt_token_ids=p) for p in prompts]
        for seq_id, prompt in zip(ids, prompts):
            t.append([seq_id], prompt.size, token_ids=prompt)
            log.publish()
        batch = np.array(ids, dtype=np.uint64)
        for tokens in rng.integers(1, 2**31, size=(3 * BS, len(ids)), dtype=np.uint32):
            t.append(batch, token_ids=tokens)
            pairs = t.take_stores().pairs
            t.tier.commit(pairs[:, 1].tolist())
            log.publish()
        t.manager.free(ids)
        log.publish()


def tracked_after_collection() -> Counter[str]:
    """The objects the collector tracks, by type, after a full collection."""
    gc.collect()
    return Counter(type(o).__name__ for o in gc.get_objects())


def test_a_warm_cache_leaves_no_object_per_block_to_the_collector() -> None:
    t = Tiered(num_blocks=NUM_BLOCKS, block_size=BS, tier_blocks=2 * NUM_BLOCKS)
    log = KVEventLog(epoch=1)
    log.attach(t.manager.allocator.cache)
    warm(t, log, rounds=2, seed=1)  # every structure at its working size: what grows after is per block
    before = tracked_after_collection()
    warm(t, log, rounds=12, seed=2)
    more = tracked_after_collection() - before
    grown = sum(more.values())
    cache = t.manager.allocator.cache
    buffered = log.since(log.next_seq - len(log.batches)) or []
    held = cache.num_cached + t.tier.num_committed + sum(len(b.events) for b in buffered)
    del buffered
    assert cache.num_cached > NUM_BLOCKS // 2 and t.tier.num_committed > NUM_BLOCKS // 2 and len(log.batches) > 20
    last = log.newest  # the last batch, as published
    newest = 2 * len(last.events) + 2 if last is not None else 0
    # Before the records were kept untracked: one CachedBlock per cached block and per host slot, a BlockStored
    # and its token array per buffered event: ~11,000 objects more here (a tenth: room for other tests' garbage).
    assert grown < held // 10 + newest, f"{grown} more tracked objects for {held} blocks and events held"
    assert more["CachedBlock"] == 0 and more["EventBatch"] <= 1 and more["BlockStored"] <= newest, more
    t.check_invariants()


def test_after_the_policy_a_full_collection_walks_no_records_list() -> None:
    t = Tiered(num_blocks=NUM_BLOCKS, block_size=BS, tier_blocks=2 * NUM_BLOCKS)  # "start-up"
    cache = t.manager.allocator.cache
    try:
        gc_policy.apply()
        log = KVEventLog(epoch=1)
        log.attach(cache)
        warm(t, log, rounds=4, seed=3)
        gc.collect()
        walked = {id(o) for o in gc.get_objects()}  # what the next full collection walks (gc.freeze: not these)
        for held in (cache.entries.records, t.tier.entries.records, cache.evictable):
            assert id(held) not in walked
        assert len(cache.entries) >= NUM_BLOCKS // 2
    finally:
        gc.unfreeze()
