"""The core's side of a host-tier restore copied with the service's lock released, and of evictions that never
copy under it (docs/prefix-caching.md, "The host tier"): a staged restore's references and pinned slots are
accounted for by check_invariants until it is finished; a second restore of the same prompt stops at a pinned slot
(a miss, never a half-copied block); with ``offload_on_evict`` off an eviction plans no store and drops the hash."""

from __future__ import annotations

import pytest

from kvpool_server.core import InvariantViolationError
from tests.offload.test_host_tier import commit_offloads, fill_pool_with_others, prefill, prompt_of
from tests.offload.tiered import Tiered


def evicted(offload_on_evict: bool = True) -> tuple[Tiered, list[int]]:
    t = Tiered(num_blocks=8, block_size=4, tier_blocks=64)
    first = prompt_of(0)
    t.manager.free(prefill(t, first))
    fill_pool_with_others(t)
    t.tier.offload_on_evict = offload_on_evict
    return t, first


def test_a_staged_restore_is_accounted_for_and_a_second_one_stops_at_its_pinned_slots() -> None:
    t, first = evicted()
    manager, tier = t.manager, t.tier
    staged = t.stage_restore(None, first)
    assert staged is not None and len(staged.pairs) == 3
    commit_offloads(t)  # what the driver runs before the restore's copy: the staging's stores
    t.check_invariants()  # mid-copy: the references no table holds are the restore's
    assert t.stage_restore(None, first) is None  # its slots are pinned: the second restore takes nothing
    manager.free(manager.register(prompt_token_ids=first))
    commit_offloads(t)
    assert manager.prefix.hit_tokens == 0  # the fresh blocks are not matchable before finish
    chain = manager.held_outside.pop(staged.key)
    with pytest.raises(InvariantViolationError):
        manager.check_invariants()  # references nobody accounts for
    manager.held_outside[staged.key] = chain
    t.finish_restore(staged, ok=True)
    assert not tier.restoring and not tier.pinned and not manager.held_outside
    t.check_invariants()
    seq = manager.register(prompt_token_ids=first)
    assert manager.num_tokens(seq) == 12


def test_without_offload_on_evict_an_eviction_stages_no_copy() -> None:
    t, first = evicted(offload_on_evict=False)
    tier = t.tier
    offloaded = tier.num_offloaded
    fill_pool_with_others(t, start=50)  # evicts everything again: none of it is in the tier
    assert tier.num_offloaded == offloaded and not len(t.take_stores().pairs)
    assert t.stage_restore(None, prompt_of(50)) is None  # dropped: a miss
    staged = t.stage_restore(None, first)  # what the tier held before is still there
    assert staged is not None
    t.finish_restore(staged, ok=True)
    t.check_invariants()
