"""CheckInvariants checks a copy of the manager (invariant_checks.copy_state): the copy must carry every part of the
state -- the prefix cache's evictable LRU (an OrderedDict) included -- or the check judges a state that never was."""

import copy

import pytest

from kvpool_server.core import InvariantViolationError, KVCacheManager
from kvpool_server.service.invariant_checks import copy_state


def test_the_snapshot_carries_the_prefix_cache_and_is_checked_like_the_original():
    manager = KVCacheManager(num_blocks=64, block_size=16)
    snapshot = copy.deepcopy(manager)  # made at start-up, when nothing is cached
    prompt = list(range(176))
    seq_id = manager.register(prompt_token_ids=prompt)
    manager.append(seq_id, 176, token_ids=prompt)
    manager.append(seq_id, 1, token_ids=[5])  # seals the 11 full blocks
    manager.free(seq_id)  # they become evictable
    copy_state(manager, snapshot)
    assert list(snapshot.allocator.cache.evictable) == list(manager.allocator.cache.evictable) and \
        len(manager.allocator.cache.evictable) == 11
    snapshot.check_invariants()
    manager.allocator.cache.evictable.popitem()  # corrupt the original: the next snapshot must see it
    copy_state(manager, snapshot)
    with pytest.raises(InvariantViolationError):
        snapshot.check_invariants()
