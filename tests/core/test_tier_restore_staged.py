"""The core's side of a host-tier restore copied with the service's lock released, and of evictions that never
copy under it (docs/prefix-caching.md, "The host tier"): a staged restore's references and pinned slots are
accounted for by check_invariants until it is finished; a second restore of the same prompt stops at a pinned slot
(a miss, never a half-copied block); with ``offload_on_evict`` off an eviction stages no copy and drops the hash."""

from __future__ import annotations

import pytest

from kvpool_server.core import InvariantViolationError, KVCacheManager
from tests.core.test_host_tier import commit_offloads, fill_pool_with_others, prefill, prompt_of


def evicted(offload_on_evict: bool = True) -> tuple[KVCacheManager, list[int]]:
    manager = KVCacheManager(num_blocks=8, block_size=4, host_tier_blocks=64)
    first = prompt_of(0)
    manager.free(prefill(manager, first))
    fill_pool_with_others(manager)
    assert manager.host_tier is not None
    manager.host_tier.offload_on_evict = offload_on_evict
    return manager, first


def test_a_staged_restore_is_accounted_for_and_a_second_one_stops_at_its_pinned_slots() -> None:
    manager, first = evicted()
    tier = manager.host_tier
    assert tier is not None
    staged = manager.prefix.stage_restore(None, first)
    assert staged is not None and len(staged.pairs) == 3
    commit_offloads(manager)  # what the service's flush does before the restore's copy
    manager.check_invariants()  # mid-copy: the references no table holds are the restore's
    assert manager.prefix.stage_restore(None, first) is None  # its slots are pinned: the second restore takes nothing
    manager.free(manager.register(prompt_token_ids=first))
    commit_offloads(manager)
    assert manager.prefix.hit_tokens == 0  # the fresh blocks are not matchable before finish
    tier.restoring.clear()
    with pytest.raises(InvariantViolationError):
        manager.check_invariants()  # references nobody accounts for
    tier.restoring[staged.key] = (staged.pairs[:, 0].tolist(), staged.chain)
    manager.prefix.finish_restore(staged, ok=True)
    assert not tier.restoring and not tier.pinned
    manager.check_invariants()
    seq = manager.register(prompt_token_ids=first)
    assert manager.num_tokens(seq) == 12


def test_without_offload_on_evict_an_eviction_stages_no_copy() -> None:
    manager, first = evicted(offload_on_evict=False)
    tier = manager.host_tier
    assert tier is not None
    offloaded = tier.num_offloaded
    fill_pool_with_others(manager, start=50)  # evicts everything again: none of it is in the tier
    assert tier.num_offloaded == offloaded and not tier.staged
    assert manager.prefix.stage_restore(None, prompt_of(50)) is None  # dropped: a miss
    staged = manager.prefix.stage_restore(None, first)  # what the tier held before is still there
    assert staged is not None
    manager.prefix.finish_restore(staged, ok=True)
    manager.check_invariants()
