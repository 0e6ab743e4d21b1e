"""A free of many sequences at once (``BlockTables.release``, ``BlockAllocator.decref``): the blocks it drops are
every row's, row by row in logical order, whichever way they are gathered (one rectangle and a mask, or a slice per
row when one long row would make the rectangle mostly UNSET); uncached blocks go on the free list in that order and
cached ones on the evictable LRU in its reverse (leaves evicted first), with or without blocks shared by a fork."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_server.core import KVCacheManager

BS = 4


def expected_after_free(manager: KVCacheManager, seqs: list[int]) -> tuple[list[int], list[int]]:
    """The blocks a free of ``seqs`` should park (in LRU order) and push (computed before it)."""
    allocator, cache = manager.allocator, manager.allocator.cache
    held = np.concatenate([manager.block_table(s) for s in seqs]).tolist()
    remaining = {b: allocator.ref_count.item(b) for b in held}
    for b in held:
        remaining[b] -= 1
    freed_order = []  # each freed block at its first position
    seen = set()
    for b in held:
        if remaining[b] == 0 and b not in seen:
            seen.add(b)
            freed_order.append(b)
    parked, last_seen = [], set()
    for b in reversed(held):  # a block's last position in ``held`` decides its place in the LRU
        if remaining[b] == 0 and cache.is_cached.item(b) and b not in last_seen:
            last_seen.add(b)
            parked.append(b)
    uncached = [b for b in freed_order if not cache.is_cached.item(b)]
    return parked, uncached


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 60), min_size=2, max_size=12), long_row=st.booleans(),
       fork_of=st.none() | st.integers(0, 11), cached=st.booleans())
def test_free_of_many_rows_drops_every_block_in_order(lengths: list[int], long_row: bool, fork_of: int | None,
                                                      cached: bool) -> None:
    if long_row:
        lengths[0] = 400  # the rectangle would be mostly UNSET: a slice per row
    manager = KVCacheManager(num_blocks=1024, block_size=BS, max_seq_len=512)
    rng = np.random.default_rng(sum(lengths))
    seqs = []
    for n in lengths:
        prompt = rng.integers(0, 2**31, size=n, dtype=np.uint32)
        seq = manager.register(prompt_token_ids=prompt if cached else None)
        manager.append(seq, n, token_ids=prompt if cached else None)
        seqs.append(seq)
    if cached:  # seal the prompts' full blocks: a decode step
        manager.append(seqs, token_ids=rng.integers(0, 2**31, size=len(seqs), dtype=np.uint32))
    if fork_of is not None:
        seqs += manager.fork(seqs[fork_of % len(seqs)], 2)
    manager.check_invariants()
    order = rng.permutation(len(seqs)).tolist()
    freeing = [seqs[i] for i in order]
    parked, uncached = expected_after_free(manager, freeing)
    evictable_before = list(manager.allocator.cache.evictable)
    num_free = manager.allocator.num_free_blocks
    freed = manager.free(freeing)
    manager.check_invariants()
    assert list(manager.allocator.cache.evictable) == evictable_before + parked
    assert freed == len(parked) + len(uncached)
    free_list = manager.allocator.free_block_ids()
    assert sorted(free_list[num_free:].tolist()) == sorted(uncached)
    if fork_of is None:  # nothing shared: the uncached blocks are pushed in the rows' order
        assert free_list[num_free:].tolist() == uncached
    assert manager.allocator.num_used_blocks == 0 and manager.tables.num_live_rows() == 0
    assert (manager.tables.table == -1).all()
