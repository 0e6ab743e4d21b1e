"""The order in which one Free of several sequences parks their cached blocks on the evictable LRU (docs/api.md,
"Free and the LRU"): the batch's blocks in reverse, so the last sequence's tail is evicted first and the first
sequence's first block last; within each sequence a block's leaves go before it."""

from __future__ import annotations

import numpy as np

from kvpool_server.core import KVCacheManager

BS = 4


def test_one_free_parks_the_batch_last_sequence_tail_first():
    manager = KVCacheManager(num_blocks=16, block_size=BS, max_seq_len=40)
    seqs = []
    for i in range(3):
        prompt = np.arange(i * 100, i * 100 + 2 * BS + 1, dtype=np.uint32)  # two full blocks and one token
        seq = manager.register(None, 0, None, prompt[:1])
        manager.append(seq, len(prompt) - 1, token_ids=prompt[1:])
        manager.append(seq, 1, token_ids=[7])  # seals the two full blocks: cached
        seqs.append(seq)
    tables = [manager.block_table(s)[:2].tolist() for s in seqs]
    manager.free(seqs)
    evicted_first_to_last = list(manager.allocator.cache.evictable)
    assert evicted_first_to_last == [b for table in reversed(tables) for b in reversed(table)]
    manager.check_invariants()
