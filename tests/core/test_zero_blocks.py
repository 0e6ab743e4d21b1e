"""AppendPlan.zero_block_ids: the blocks an append takes that still hold another owner's KV (issue 20, item 1).

Memory is simulated with one tag per slot (``tag_memory``): a sequence writes its tag into the slots an append
hands it; the device layer's part is replayed as documented (clear ``zero_block_ids``, then run ``copies``).
"""

from __future__ import annotations

import numpy as np

from kvpool_server.core import KVCacheManager
from kvpool_server.core.types import EMPTY_BLOCKS

from .conftest import run_copies, tag_memory

BS = 4


def execute(memory: np.ndarray, plan, tag: int) -> None:
    """What the device layer and the writer do with a plan: clear, copy, write the new slots."""
    for block_id in plan.zero_block_ids.tolist():
        memory[block_id * BS : (block_id + 1) * BS] = -1
    run_copies(memory, plan.copies, BS)
    memory[plan.slot_mapping] = tag


def visible_tags(manager: KVCacheManager, memory: np.ndarray, seq_id: int) -> set[int]:
    """Every tag in the slots of the blocks a sequence holds, written or not."""
    blocks = manager.block_table(seq_id)
    return set(np.concatenate([memory[b * BS : (b + 1) * BS] for b in blocks.tolist()]).tolist())


def test_a_step_that_takes_no_block_clears_nothing_and_allocates_nothing() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    seqs = [manager.register() for _ in range(3)]
    manager.append(seqs, 2)
    plan = manager.append(seqs)  # one token each, inside their blocks
    assert plan.new_block_ids.size == 0 and plan.zero_block_ids is EMPTY_BLOCKS
    plan = manager.append(seqs[0], 1)  # one sequence, the scalar path
    assert plan.zero_block_ids is EMPTY_BLOCKS


def test_new_blocks_from_the_free_list_are_cleared() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    seqs = [manager.register() for _ in range(3)]
    plan = manager.append(seqs, [5, 1, 9])  # the general path
    assert plan.zero_block_ids.dtype == np.int32
    assert sorted(plan.zero_block_ids.tolist()) == sorted(plan.new_block_ids.tolist()) and plan.new_block_ids.size == 6
    plan = manager.append(seqs, [3, 3, 3])  # to 8, 4, 12 tokens: no new block
    assert plan.new_block_ids.size == 0 and plan.zero_block_ids.size == 0
    plan = manager.append(seqs)  # the decode path opens a block for each
    assert plan.zero_block_ids.tolist() == plan.new_block_ids.tolist() and plan.new_block_ids.size == 3
    plan = manager.append(seqs[1], 8)  # the scalar path, several blocks
    assert plan.zero_block_ids.tolist() == plan.new_block_ids.tolist() and plan.new_block_ids.size == 2


def test_copy_on_write_destinations_are_not_cleared() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    parent = manager.register()
    manager.append(parent, 6)  # blocks [A | B..], B partly filled
    (child,) = manager.fork(parent, 1)
    plan = manager.append([child, parent], [3, 1])  # the child copies B, then grows one block; the parent writes B
    assert plan.copies.shape == (1, 2)
    dst = plan.copies[0, 1]
    assert dst in plan.new_block_ids and dst not in plan.zero_block_ids
    assert plan.zero_block_ids.tolist() == [b for b in plan.new_block_ids.tolist() if b != dst]


def test_freed_kv_never_reaches_the_next_owner() -> None:
    """A freed sequence's tags stay in its blocks; the next owner of those blocks sees only its own (or none)."""
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    memory = tag_memory(manager)
    old = manager.register()
    execute(memory, manager.append(old, 8 * BS - 2), tag=1)  # every block of the pool, the last partly
    manager.free(old)
    new = manager.register()
    execute(memory, manager.append(new, 1), tag=2)
    execute(memory, manager.append(new, BS + 1), tag=2)
    assert visible_tags(manager, memory, new) == {2, -1}
    parent = manager.register()
    execute(memory, manager.append(parent, 2), tag=3)
    (child,) = manager.fork(parent, 1)
    execute(memory, manager.append(child, 1), tag=4)  # a copy of the parent's block: the parent's KV, rightly
    assert visible_tags(manager, memory, child) == {3, 4, -1}


def test_evicted_cached_blocks_are_cleared_and_adopted_ones_are_not() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    memory = tag_memory(manager)
    prompt = list(range(2 * BS + 1))
    a = manager.register()
    execute(memory, manager.append(a, len(prompt), token_ids=prompt), tag=1)
    execute(memory, manager.append(a, 1, token_ids=[0]), tag=1)  # seals the two full blocks
    cached = set(manager.block_table(a)[:2].tolist())
    manager.free(a)
    b = manager.register(prompt_token_ids=prompt)  # adopts the two cached blocks: their KV is the point
    assert manager.num_tokens(b) == 2 * BS and set(manager.block_table(b).tolist()) == cached
    plan = manager.append(b, 1, token_ids=prompt[-1:])
    assert not cached & set(plan.zero_block_ids.tolist()) and plan.zero_block_ids.size == 1
    manager.free(b)
    c = manager.register()
    plan = manager.append(c, 4 * BS)  # every block, the cached ones evicted from the LRU
    assert sorted(plan.zero_block_ids.tolist()) == [0, 1, 2, 3]
    execute(memory, plan, tag=2)
    assert visible_tags(manager, memory, c) == {2}
