"""Prefix caching in the core: block hashes, sealing, reuse on register, the evictable LRU, salts, and a corrupting
test for each invariant (docs/prefix-caching.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from array import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_server.core import FailedPreconditionError, InvalidArgumentError, InvariantViolationError, KVCacheManager
from kvpool_server.core.block_hash import NONE_HASH, PUBLIC_SALT, block_hash, chain_hashes
from kvpool_server.core.prefix_cache import CachedBlock, PrefixCache

from .conftest import tag_memory

BS = 4
PROMPT = list(range(100, 111))  # 11 tokens: 2 full blocks and 3 more

# The documented test vector (docs/prefix-caching.md): a router's implementation must reproduce it.
GOLD_FIRST = "50c8a1f596013ab4fbc14562ca937a507533de34242e14b680d41c3964d25c2a"  # tokens [1, 2, 3, 4], no salt
GOLD_SECOND_SALTED = "0608765c2432da41fccf5446a9928def613bd33b5cd8bad3274e5605899a652f"  # range(8), salt b"acme"


def test_hash_matches_the_documented_vector() -> None:
    assert block_hash(NONE_HASH, [1, 2, 3, 4]).hex() == GOLD_FIRST
    assert chain_hashes(list(range(8)), 4, b"acme")[1].hex() == GOLD_SECOND_SALTED


def test_hash_is_stable_across_processes() -> None:
    """Two interpreters with different PYTHONHASHSEEDs agree: nothing depends on Python's hash()."""
    code = "from kvpool_server.core.block_hash import chain_hashes; print(chain_hashes(range(64), 16, b't')[-1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        for seed in ("1", "2", "random")
    }
    assert outs == {chain_hashes(range(64), 16, b"t")[-1].hex()}


def test_hash_depends_on_parent_tokens_and_salt() -> None:
    h = block_hash(NONE_HASH, [1, 2, 3, 4])
    assert len({h, block_hash(h, [1, 2, 3, 4]), block_hash(NONE_HASH, [1, 2, 3, 5]),
                block_hash(NONE_HASH, [1, 2, 3, 4], b"x")}) == 4


def prefill(manager: KVCacheManager, prompt=PROMPT, tenant=None) -> int:
    seq = manager.register(prompt_token_ids=prompt, tenant=tenant)
    done = manager.num_tokens(seq, tenant)
    manager.append(seq, len(prompt) - done, tenant=tenant, token_ids=prompt[done:])
    return seq


def test_full_blocks_are_matchable_only_once_sealed() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = prefill(manager)
    assert manager.allocator.cache.num_cached == 0  # filled, not sealed: the KV may not be written yet
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT)) == 0
    manager.append(a, 1, token_ids=[7])  # a's next call seals its two full blocks
    assert manager.allocator.cache.num_cached == 2
    b = manager.register(prompt_token_ids=PROMPT)
    assert manager.num_tokens(b) == 8
    assert np.array_equal(manager.block_table(b), manager.block_table(a)[:2])
    assert manager.allocator.ref_count[manager.block_table(a)[:2]].tolist() == [2, 2]
    manager.check_invariants()


def test_a_sequence_freed_before_sealing_leaves_nothing_matchable() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    manager.free(prefill(manager))
    assert manager.allocator.cache.num_cached == 0 and manager.stats().num_blocks_free == 16
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT)) == 0


def test_one_token_is_always_left_to_compute() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = prefill(manager, PROMPT[:8])
    manager.append(a, 1, token_ids=[1])
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT[:8])) == 4
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT[:9])) == 8


def test_token_ids_must_cover_every_appended_token() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    seq = manager.register(prompt_token_ids=[])
    with pytest.raises(InvalidArgumentError):
        manager.append(seq, 3, token_ids=[1, 2])
    assert manager.num_tokens(seq) == 0


def test_released_cached_blocks_are_evictable_then_evicted_leaves_first() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = prefill(manager)
    manager.append(a, 1, token_ids=[7])
    first, second = manager.block_table(a)[:2].tolist()
    manager.free(a)
    stats = manager.stats()
    assert (stats.num_blocks_evictable, stats.num_blocks_free, stats.num_blocks_used) == (2, 4, 0)
    assert list(manager.allocator.cache.evictable) == [second, first]  # the leaf is evicted first
    b = manager.register()
    appended = manager.stats().num_tokens_appended
    manager.append(b, 5 * BS)  # 4 free blocks, then one evicted: the leaf
    assert manager.allocator.cache.num_cached == 1 and first not in manager.block_table(b).tolist()
    stats = manager.stats()  # the counters since start
    assert (stats.num_blocks_evicted, stats.num_tokens_appended - appended) == (1, 5 * BS)
    c = manager.register(prompt_token_ids=PROMPT)
    assert manager.num_tokens(c) == 4  # the first block still matches; the evicted one's hash is gone
    manager.check_invariants()
    manager.free([b, c])
    manager.append(manager.register(), 6 * BS)  # everything, evicting the rest
    assert manager.allocator.cache.num_cached == 0 and manager.stats().num_blocks_evicted == 2
    manager.check_invariants()


def test_cached_kv_reads_back_what_the_first_writer_wrote_and_forks_share_it() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS)
    memory = tag_memory(manager)
    a = manager.register(prompt_token_ids=PROMPT)
    plan = manager.append(a, len(PROMPT), token_ids=PROMPT)
    memory[plan.slot_mapping] = np.arange(len(PROMPT)) + 1000
    manager.append(a, 1, token_ids=[5])
    manager.free(a)
    b = manager.register(prompt_token_ids=PROMPT)
    assert memory[manager.slots(b, 0, 8)].tolist() == list(range(1000, 1008))
    manager.append(b, len(PROMPT) - 8, token_ids=PROMPT[8:])
    beams = manager.fork(b, 3)  # beam search over a cached prompt
    for i, beam in enumerate(beams):
        plan = manager.append(beam, 2, token_ids=[i, i])
        memory[plan.slot_mapping] = [i, i]  # copy-on-write of the shared partial block
    for beam in beams:
        assert memory[manager.slots(beam, 0, 8)].tolist() == list(range(1000, 1008))
        assert manager.block_table(beam)[:2].tolist() == manager.block_table(b)[:2].tolist()
    manager.check_invariants()


def test_sealed_cached_blocks_are_not_writable() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = prefill(manager)
    manager.slots(a, 0, 4, for_write=True)  # not sealed yet: the caller is still writing it
    manager.append(a, 1, token_ids=[7])
    with pytest.raises(FailedPreconditionError):
        manager.slots(a, 0, 4, for_write=True)


def test_different_salts_never_share() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS, tenancy=True)
    acme, other = manager.tenants.tenant_id("acme"), manager.tenants.tenant_id("other")
    a = prefill(manager, tenant=acme)
    manager.append(a, 1, tenant=acme, token_ids=[7])
    assert manager.num_tokens(manager.register(tenant=other, prompt_token_ids=PROMPT), other) == 0
    assert manager.num_tokens(manager.register(tenant=acme, prompt_token_ids=PROMPT), acme) == 8
    assert manager.tenants.num_blocks[acme] == 3
    manager.check_invariants()


def test_reused_blocks_count_against_the_tenants_quota() -> None:
    from kvpool_server.core.tenants import TenantLimits
    manager = KVCacheManager(num_blocks=32, block_size=BS, tenancy=True)
    acme = manager.tenants.tenant_id("acme")
    a = prefill(manager, tenant=acme)
    manager.append(a, 1, tenant=acme, token_ids=[7])
    manager.free(a, acme)
    manager.tenants.set_limits(acme, TenantLimits(max_blocks=1))
    assert manager.num_tokens(manager.register(tenant=acme, prompt_token_ids=PROMPT), acme) == 4  # one revived, not two
    assert manager.tenants.num_blocks[acme] == 1
    manager.check_invariants()


# ---------------------------------------------------------------- corrupting tests, one per invariant
@pytest.fixture
def cached() -> KVCacheManager:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = prefill(manager)
    manager.append(a, 1, token_ids=[7])
    manager.free(prefill(manager, [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    b = manager.register(prompt_token_ids=[9, 9, 9, 9, 9])
    manager.append(b, 5, token_ids=[9] * 5)
    manager.append(b, 1, token_ids=[9])
    manager.free(b)  # one cached block, evictable
    manager.check_invariants()
    return manager


def test_a_hash_that_does_not_match_its_content_is_caught(cached: KVCacheManager) -> None:
    cache = cached.allocator.cache
    block_id, entry = next(iter(cache.entries.items()))
    cache.entries[block_id] = CachedBlock(entry.block_hash, entry.parent_hash, entry.token_ids + 1, entry.salt)
    with pytest.raises(InvariantViolationError, match="content chain"):
        cached.check_invariants()


def test_an_evictable_block_in_use_is_caught(cached: KVCacheManager) -> None:
    in_use = next(b for b in cached.allocator.cache.entries if cached.allocator.ref_count[b] > 0)
    cached.allocator.cache.evictable[in_use] = None
    with pytest.raises(InvariantViolationError, match="evictable"):
        cached.check_invariants()


def test_a_cached_idle_block_missing_from_the_lru_is_caught(cached: KVCacheManager) -> None:
    cached.allocator.cache.evictable.popitem()
    with pytest.raises(InvariantViolationError):
        cached.check_invariants()


def test_a_block_both_free_and_evictable_is_caught(cached: KVCacheManager) -> None:
    allocator = cached.allocator
    allocator._push(np.array([next(iter(allocator.cache.evictable))], dtype=np.int32))
    with pytest.raises(InvariantViolationError, match="free and evictable"):
        cached.check_invariants()


# ---------------------------------------------------------------- KV events (the core of SubscribeEvents)
def test_kv_events_record_stores_and_evictions_in_numbered_batches() -> None:
    from kvpool_server.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog

    manager = KVCacheManager(num_blocks=6, block_size=BS)
    log = KVEventLog(epoch=7, capacity=2)
    log.attach(manager.allocator.cache)
    a = prefill(manager)
    manager.append(a, 1, token_ids=[7])
    first = log.publish()
    h0, h1 = chain_hashes(PROMPT, BS)
    assert first is not None and (first.epoch, first.seq) == (7, 1)
    assert first.events == (BlockStored((h0, h1), None, array("I", PROMPT[:8]), BS),)  # a run: one event
    manager.free(a)
    manager.append(manager.register(), 5 * BS)  # evicts the leaf
    assert log.publish().events == (BlockRemoved((h1,)),)
    assert log.publish() is None  # nothing pending
    assert [b.seq for b in log.since(1)] == [1, 2]
    manager.append(manager.register(), BS)  # evicts the other
    log.publish()
    assert log.num_dropped == 1 and log.since(1) is None and [b.seq for b in log.since(2)] == [2, 3]
    snap = log.snapshot(manager.allocator.cache)
    assert snap.snapshot and snap.seq == 3 and snap.events == (AllBlocksCleared(),)


def test_register_refuses_a_prompt_over_max_seq_len_before_hashing(monkeypatch, assert_unchanged) -> None:
    """Issue 20, item 8: a prompt longer than max_seq_len is INVALID_ARGUMENT, naming the limit, before any block
    of it is hashed (a huge prompt must not cost the server its hashing), and changes nothing."""
    from kvpool_server.core import prefix_reuse

    manager = KVCacheManager(num_blocks=64, block_size=BS, max_seq_len=16)
    hashed = []
    real = prefix_reuse.chain_hashes
    monkeypatch.setattr(prefix_reuse, "chain_hashes", lambda *a, **k: hashed.append(a) or real(*a, **k))
    with assert_unchanged(manager), pytest.raises(InvalidArgumentError, match="max_seq_len=16"):
        manager.register(prompt_token_ids=list(range(17)))
    assert hashed == [] and manager.num_sequences == 0
    seq = manager.register(prompt_token_ids=list(range(16)))  # exactly the limit: accepted
    assert len(hashed) == 1 and manager.num_tokens(seq) == 0


@settings(max_examples=200, deadline=None)
@given(cached=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 7)), max_size=6),
       batch=st.lists(st.tuples(st.integers(0, 15), st.integers(0, 7), st.booleans()), max_size=12))
def test_insert_many_answers_as_inserts_one_by_one(cached: list[tuple[int, int]],
                                                   batch: list[tuple[int, int, bool]]) -> None:
    """A batch of (block, hash) pairs -- hashes or blocks repeated within it or cached before it included -- is
    inserted as ``insert`` of each pair in order would: the same blocks, the same public positions, the same
    events in the same order."""
    def entry(h: int, public: bool = False) -> CachedBlock:
        tokens, salt = np.full(4, h, dtype=np.uint32), PUBLIC_SALT if public else b"t"
        return CachedBlock(block_hash(NONE_HASH, tokens, salt), NONE_HASH, tokens, salt)

    one, many = PrefixCache(16), PrefixCache(16)
    for cache in (one, many):
        cache.events = []
        for block_id, h in cached:
            cache.insert(block_id, entry(h))
    public_one = [k for k, (b, h, p) in enumerate(batch) if one.insert(b, entry(h, p)) and p]
    public_many = many.insert_many([b for b, _, _ in batch], [entry(h, p) for _, h, p in batch])
    assert public_many == public_one
    assert dict(many.block_of_hash) == dict(one.block_of_hash) and list(many.entries) == list(one.entries)
    assert [e.block_hash for e in many.entries.values()] == [e.block_hash for e in one.entries.values()]
    assert [e.block_hash for e in many.events] == [e.block_hash for e in one.events]  # type: ignore[union-attr]
    assert many.num_public == one.num_public and (many.is_public == one.is_public).all()
    assert (many.is_cached == one.is_cached).all()
    many.check_invariants(np.ones(16, dtype=np.int32))
