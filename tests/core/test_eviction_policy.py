"""The prefix cache's eviction policies (eviction_policy.py, lrfu_eviction.py): which cached block goes first."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError, KVCacheManager
from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.eviction_policy import LruEviction, make_eviction_policy
from kvpool_server.core.kv_event_types import CachedBlock
from kvpool_server.core.lrfu_eviction import LrfuEviction

BS = 4


def serve(m: KVCacheManager, prompt: np.ndarray) -> int:
    """Register with the prompt, prefill the rest, decode one token (seals), free: the tokens found cached."""
    seq_id = m.register(prompt_token_ids=prompt)
    cached = m.num_tokens(seq_id)
    m.append(seq_id, prompt.size - cached, token_ids=prompt[cached:])
    m.append(seq_id, 1)
    m.free(seq_id)
    m.check_invariants()
    return cached


def prompt(first: int, blocks: int = 2) -> np.ndarray:
    return np.arange(first, first + blocks * BS + 1, dtype=np.uint32)  # the +1: the full blocks are reusable


@pytest.mark.parametrize(("policy", "kept"), [("lru", "b"), ("lrfu", "a")])
def test_a_prompt_used_twice_outlives_a_newer_one_used_once_under_lrfu_only(policy: str, kept: str) -> None:
    # 5 blocks: room for two prompts of 2 blocks (their decode blocks freed at once) and one in use.
    m = KVCacheManager(5, BS, prefix_eviction=policy)
    a, b, c = prompt(0), prompt(100), prompt(200)
    assert serve(m, a) == 0 and serve(m, a) == 2 * BS  # a: used twice
    assert serve(m, b) == 0  # b: once, after a
    serve(m, c)  # needs 3 blocks: evicts a's or b's 2 cached blocks
    assert serve(m, a if kept == "a" else b) == 2 * BS  # LRU kept the newer b; LRFU the more used a
    assert m.allocator.cache.policy.name == policy


def test_lrfu_evicts_a_prompts_tail_before_its_head() -> None:
    m = KVCacheManager(4, BS, prefix_eviction="lrfu")
    serve(m, prompt(0, blocks=3))  # 3 blocks cached, used once each, parked tail first
    m.allocator.allocate(2)  # evicts 1 of them besides the free block
    head_tokens = sorted(int(e.token_ids[0]) for e in m.allocator.cache.entries.values())
    assert head_tokens == [0, BS]  # the tail block (tokens 8..11) went first


def entry(k: int) -> CachedBlock:
    return CachedBlock(block_hash=k.to_bytes(32, "little"), parent_hash=b"", token_ids=(k,), salt=b"")


def test_lrfu_remembers_an_evicted_blocks_count_by_hash_within_its_ghost_limit() -> None:
    policy = LrfuEviction(num_blocks=4, block_size=BS, ghost_factor=1)
    evictable: OrderedDict[int, None] = OrderedDict()
    entries = {0: entry(7), 1: entry(8)}
    for _ in range(3):  # block 0 used three times
        evictable[0] = None
        policy.parked(np.array([0]), entries, evictable)
        del evictable[0]
    evictable[0] = None
    policy.parked(np.array([0]), entries, evictable)
    first_rank = policy.rank[0]
    assert policy.victims(evictable, 1) == [0]
    del evictable[0]
    policy.evicted([0], [entries[0].block_hash])
    assert list(policy.ghost) == [entry(7).block_hash]
    assert policy.stamp[0] == -1 and not policy.known[0]
    entries[2] = entry(7)  # the same content recomputed into block 2: its count resumes
    evictable[2] = None
    policy.parked(np.array([2]), entries, evictable)
    assert policy.rank[2] > first_rank
    policy.check_invariants(evictable)
    assert entry(7).block_hash not in policy.ghost  # taken back by the block that resumed its count
    for k in range(10, 10 + policy.ghost_limit + 1):  # more than the ghost holds: cut back to the newest
        policy.ghost[entry(k).block_hash] = 0.0
    policy.evicted([], [])
    assert len(policy.ghost) == policy.ghost_keep == 4
    assert list(policy.ghost)[-1] == entry(10 + policy.ghost_limit).block_hash


def test_lrfu_ranks_equal_uses_in_park_order_and_skips_blocks_taken_back() -> None:
    policy = LrfuEviction(num_blocks=8, block_size=BS)
    evictable: OrderedDict[int, None] = OrderedDict((b, None) for b in (5, 3, 1))
    policy.parked(np.array([5, 3, 1]), {b: entry(b) for b in (5, 3, 1)}, evictable)
    del evictable[5]  # reused: taken back into use, its entry stale
    policy.unparked(np.array([5]))
    assert policy.victims(evictable, 2) == [3, 1]
    policy.check_invariants(OrderedDict())


def test_lrfu_invariants_catch_an_evictable_block_without_a_live_entry() -> None:
    policy = LrfuEviction(num_blocks=4, block_size=BS)
    evictable: OrderedDict[int, None] = OrderedDict([(2, None)])
    policy.parked(np.array([2]), {2: entry(2)}, evictable)
    policy.check_invariants(evictable)
    policy.stamp[2] = 99  # its entry's stamp is not its own any more
    with pytest.raises(InvariantViolationError):
        policy.check_invariants(evictable)


def test_lrfu_compacts_stale_entries_within_its_bound() -> None:
    policy = LrfuEviction(num_blocks=8, block_size=BS)
    evictable: OrderedDict[int, None] = OrderedDict()
    entries = {b: entry(b) for b in range(8)}
    for _ in range(400):  # each round: parked, then taken back: 8 stale entries a round
        evictable.update(dict.fromkeys(range(8)))
        policy.parked(np.arange(8), entries, evictable)
        policy.check_invariants(evictable)
        evictable.clear()
        policy.unparked(np.arange(8))
    assert policy.num_entries <= policy.max_entries and len(policy.buckets) <= policy.max_buckets
    policy.check_invariants(evictable)


def test_policies_by_name() -> None:
    assert isinstance(make_eviction_policy("lru", 8, BS), LruEviction)
    assert isinstance(make_eviction_policy("lrfu", 8, BS), LrfuEviction)
    assert make_eviction_policy("lrfu:4096", 8, 16).decay == 16 / 4096
    assert make_eviction_policy("lrfu:pool", 8, 16).decay == make_eviction_policy("lrfu", 8, 16, 0).decay == 1 / 8
    assert make_eviction_policy("lrfu", 8, 16, 256).decay == 16 / 256
    for bad in ("arc", "lrfu:", "lrfu:0", "lrfu:x"):
        with pytest.raises(InvalidArgumentError, match="unknown prefix eviction policy"):
            make_eviction_policy(bad, 8, BS)
