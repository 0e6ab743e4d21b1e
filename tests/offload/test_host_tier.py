"""The host tier's bookkeeping over the core (docs/prefix-caching.md, "The host tier"): evicted cached blocks, named
in the appends' plans, are stored into host slots (matchable only once committed), a register's prompt is restored
from them, failures fall back to a miss, the events name the tier, and check_invariants covers it."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.core import InvariantViolationError, prefix_reuse
from kvpool_server.core.kv_event_types import BlockRemoved, BlockStored
from kvpool_server.core.kv_events import KVEventLog
from tests.offload.tiered import Tiered

BS = 4


def prefill(t: Tiered, prompt: list[int]) -> int:
    """Register (with the restores a service would run, all succeeding), append the rest, seal."""
    manager = t.manager
    restore(t, prompt, ok=True)
    seq = manager.register(prompt_token_ids=prompt)
    done = manager.num_tokens(seq)
    t.append(seq, len(prompt) - done, token_ids=prompt[done:])
    t.append(seq, 1, token_ids=[7])  # seals the prompt's last full block
    commit_offloads(t)
    return seq


def commit_offloads(t: Tiered, ok: bool = True) -> np.ndarray:
    pairs = t.take_stores().pairs
    if t.tier is not None:
        (t.tier.commit if ok else t.tier.abort)(pairs[:, 1].tolist())
    return pairs


def restore(t: Tiered, prompt: list[int], ok: bool) -> np.ndarray:
    staged = t.stage_restore(None, prompt)
    commit_offloads(t)
    if staged is None:
        return np.zeros((0, 2), dtype=np.int32)
    t.finish_restore(staged, ok)
    return staged.pairs


def prompt_of(i: int, blocks: int = 3) -> list[int]:
    return [1000 * i + t for t in range(blocks * BS + 1)]


def fill_pool_with_others(t: Tiered, start: int = 1) -> None:
    """Prefill and free prompts until every block of the pool was used since: the first ones are evicted."""
    for i in range(start, start + t.manager.num_blocks // 3 + 2):
        t.manager.free(prefill(t, prompt_of(i)))


def test_evicted_blocks_spill_and_come_back() -> None:
    t = Tiered(num_blocks=8, block_size=BS, tier_blocks=64)
    manager, first = t.manager, prompt_of(0)
    manager.free(prefill(t, first))
    fill_pool_with_others(t)
    tier = t.tier
    assert tier is not None and tier.num_offloaded >= 3
    hashes = prefix_reuse.reusable_hashes(np.array(first, np.uint32), BS, b"", 0, b"")
    assert manager.allocator.cache.match(hashes) == []
    pairs = restore(t, first, ok=True)
    assert len(pairs) == 3
    seq = manager.register(prompt_token_ids=first)
    assert manager.num_tokens(seq) == 3 * BS  # num_cached_tokens counts the restored blocks
    assert manager.block_table(seq).tolist() == pairs[:, 1].tolist()
    assert tier.num_restored * BS == 3 * BS  # the host hit tokens (PoolStats.prefix_host_hit_tokens)
    t.check_invariants()


def test_a_failed_restore_is_a_miss_and_fences_the_slots() -> None:
    t = Tiered(num_blocks=8, block_size=BS, tier_blocks=64)
    manager, first = t.manager, prompt_of(0)
    manager.free(prefill(t, first))
    fill_pool_with_others(t)
    free_before = manager.allocator.num_allocatable
    restore(t, first, ok=False)
    assert manager.allocator.num_allocatable == free_before  # the fresh blocks went back
    seq = manager.register(prompt_token_ids=first)
    assert manager.num_tokens(seq) == 0  # a miss, never another block's KV
    assert t.stage_restore(None, first) is None  # fenced: the slots are gone from the tier
    t.check_invariants()


def test_an_uncommitted_offload_is_not_matchable_and_a_failed_one_is_lost() -> None:
    t = Tiered(num_blocks=8, block_size=BS, tier_blocks=64)
    manager = t.manager
    log = KVEventLog(epoch=1)
    log.attach(manager.allocator.cache)
    first = prompt_of(0)
    manager.free(prefill(t, first))
    seq = manager.register(prompt_token_ids=prompt_of(1, blocks=8)[: 8 * BS])
    plan = t.append(seq, 8 * BS, token_ids=prompt_of(1, blocks=8)[: 8 * BS])  # every block: evicts the first prompt
    tier = t.tier
    assert len(plan.evicted.block_ids) == 3  # the plan names the blocks its append evicted
    assert len(t.stores[-1].pairs) == 3 and not tier.slot_of_hash
    assert t.stage_restore(None, first) is None  # pending slots are not matchable
    commit_offloads(t, ok=False)
    removed = [e for e in log.pending if isinstance(e, BlockRemoved)]
    assert removed and len(removed[-1].block_hashes) == 3 and removed[-1].medium == ""
    t.check_invariants()


def test_events_name_the_host_tier() -> None:
    t = Tiered(num_blocks=8, block_size=BS, tier_blocks=3)
    manager = t.manager
    log = KVEventLog(epoch=1)
    log.attach(manager.allocator.cache)
    manager.free(prefill(t, prompt_of(0)))
    log.publish()
    fill_pool_with_others(t)
    batch = log.publish()
    assert batch is not None
    cpu_stored = [e for e in batch.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    cpu_removed = [e for e in batch.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert cpu_stored and cpu_removed  # 3 slots: later offloads drop the oldest
    tier = t.tier
    snapshot = log.snapshot(manager.allocator.cache, tier.stored_events())
    in_snapshot = {h for e in snapshot.events if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes}
    assert in_snapshot == set(tier.slot_of_hash) - set(manager.allocator.cache.block_of_hash)


def test_the_hit_rate_is_higher_with_the_tier() -> None:
    def hits(tier_blocks: int) -> int:
        t = Tiered(num_blocks=12, block_size=BS, tier_blocks=tier_blocks)
        for _ in range(3):
            for i in range(8):  # 8 prompts of 3 blocks: twice the pool
                t.manager.free(prefill(t, prompt_of(i)))
        t.check_invariants()
        return t.manager.prefix.hit_tokens

    assert hits(64) > hits(0)


def test_a_restore_never_evicts_the_prompts_own_pool_blocks() -> None:
    """A prompt half in the pool, half in the tier: with no room but the prompt's own cached blocks nothing is
    restored (the pool's part stays matchable); with room, the rest comes back."""
    t = Tiered(num_blocks=6, block_size=BS, tier_blocks=64)
    manager, first = t.manager, prompt_of(0, blocks=4)
    manager.free(prefill(t, first))  # 4 cached blocks (evictable) + 2 free
    hold = manager.register()
    t.append(hold, 3 * BS)  # 3 blocks: the 2 free ones and the prompt's last (evicted, offloaded)
    commit_offloads(t)
    assert t.stage_restore(None, first) is None  # restoring would evict the prompt's own blocks
    seq = manager.register(prompt_token_ids=first)
    assert manager.num_tokens(seq) == 3 * BS
    manager.free([seq, hold])
    staged = t.stage_restore(None, first)
    commit_offloads(t)
    assert staged is not None and len(staged.pairs) == 1
    t.finish_restore(staged, True)
    seq = manager.register(prompt_token_ids=first)
    assert manager.num_tokens(seq) == 4 * BS
    t.check_invariants()


def test_check_invariants_catches_a_broken_tier() -> None:
    t = Tiered(num_blocks=8, block_size=BS, tier_blocks=64)
    manager = t.manager
    manager.free(prefill(t, prompt_of(0)))
    fill_pool_with_others(t)
    tier = t.tier
    t.check_invariants()
    slot = next(iter(tier.lru))
    tier.lru.pop(slot)
    with pytest.raises(InvariantViolationError, match="LRU"):
        t.check_invariants()
    tier.lru[slot] = None
    tier.free.append(slot)
    with pytest.raises(InvariantViolationError, match="two of"):
        t.check_invariants()
    tier.free.pop()
    manager.allocator.cache.evicted_ids.append(0)  # an eviction left behind, out of its call's plan (not stored)
    with pytest.raises(InvariantViolationError, match="left out of their call's plan"):
        t.check_invariants()


def test_tenants_salts_and_public_prefixes_hold_across_the_tier() -> None:
    """With tenancy and quotas: a tenant's blocks restored from the tier are its own (another tenant's prompt does
    not match them), a public prefix restored is adopted by any tenant and charged as usual."""
    from kvpool_server.core.tenants import TenantLimits

    t = Tiered(num_blocks=12, block_size=BS, tier_blocks=32, tenancy=True)
    manager = t.manager
    a, b = manager.tenants.tenant_id("a"), manager.tenants.tenant_id("b")
    manager.tenants.set_limits(a, TenantLimits(max_blocks=10))
    system = list(range(200, 208))  # two full blocks, public
    prompt = [*system, 1, 2, 3, 4, 5]

    def prefill_as(tenant: int) -> tuple[int, int]:
        staged = t.stage_restore(tenant, prompt, len(system))
        commit_offloads(t)
        if staged is not None:
            t.finish_restore(staged, True)
        seq = manager.register(tenant=tenant, prompt_token_ids=prompt, public_prefix_len=len(system))
        cached = manager.num_tokens(seq, tenant)
        t.append(seq, len(prompt) - cached, tenant=tenant, token_ids=prompt[cached:])
        t.append(seq, 1, tenant=tenant, token_ids=[9])
        commit_offloads(t)
        return seq, cached

    seq, _ = prefill_as(a)
    manager.free(seq, tenant=a)
    hog = manager.register(tenant=b)
    t.append(hog, 12 * BS, tenant=b)  # every block: a's prompt goes to the tier
    commit_offloads(t)
    manager.free(hog, tenant=b)
    assert manager.allocator.cache.num_cached == 0 and t.tier is not None
    assert t.tier.num_committed == 3
    seq_b, cached_b = prefill_as(b)
    assert cached_b == len(system)  # the public blocks only, restored; a's own block is a's
    seq_a, cached_a = prefill_as(a)
    assert cached_a == 3 * BS
    t.check_invariants()
