"""The write-back's scan hint when its mark is taken back into use and parked again (``scan_mark.MarkWatch``): the
mark lands at the LRU's end, which may be the very position the hint names, with a block before it that no scan
looked at (the stateful tier test found such a sequence); the watch voids the hint at the unpark."""

from __future__ import annotations

import numpy as np

from kvpool_server.core import KVCacheManager
from kvpool_server.core.block_hash import NONE_HASH, block_hash
from kvpool_server.core.kv_event_types import CachedBlock
from kvpool_server.offload import writeback
from kvpool_server.offload.host_tier import HostTier


def test_a_mark_parked_again_at_its_own_position_voids_the_hint() -> None:
    tier = HostTier(KVCacheManager(num_blocks=1, block_size=1), 4)
    tier.offload_on_evict = False  # the write-back thread's mode
    cache, entries = tier.cache, {}

    def cached(block: int) -> None:  # a sealed block of the pool's cache, parked on its LRU
        tokens = np.array([block], dtype=np.uint32)
        h = block_hash(NONE_HASH, tokens, b"", b"")
        entries[block] = CachedBlock(h, NONE_HASH, tokens, b"", b"")
        cache.block_of_hash[h] = block
        cache.park(np.array([block]))

    cached(0)
    cached(1)
    pairs = writeback.plan(tier, cache.evictable, entries, 2)
    writeback.finish(tier, pairs, ok=True)
    assert (tier.scan_skip, tier.scan_mark) == (2, 1)  # the run [0, 1], both in the tier
    cache.unpark(np.array([0, 1]))  # both taken back into use (a prefix match)
    cached(2)  # a new block, not in the tier
    cache.park(np.array([1]))  # the mark's use ends: LRU [2, 1], the mark at position 1 again
    assert tier.scan_start(cache.evictable) == 0  # not past block 2
    tier.check_invariants()
    assert writeback.plan(tier, cache.evictable, entries, 2)[:, 0].tolist() == [2]
    assert cache.policy.name == "lru"  # (the pool's own policy, read through the watch)
