import numpy as np
import pytest

from kvpool_server.core import BlockAllocator, InvalidArgumentError, InvariantViolationError, OutOfBlocksError


def test_allocate_hands_out_distinct_blocks_with_ref_one():
    allocator = BlockAllocator(8)
    blocks = allocator.allocate(5)
    assert sorted(blocks.tolist()) == sorted(set(blocks.tolist()))
    assert (allocator.ref_count[blocks] == 1).all()
    assert allocator.num_free_blocks == 3
    allocator.check_invariants()


def test_block_never_handed_out_twice_until_freed():
    allocator = BlockAllocator(4)
    first = allocator.allocate(2).tolist()
    second = allocator.allocate(2).tolist()
    assert not set(first) & set(second)
    with pytest.raises(OutOfBlocksError, match="need 1 free blocks, 0 of 4"):
        allocator.allocate(1)
    assert allocator.decref(np.array(first, dtype=np.int32)) == 2
    assert sorted(allocator.allocate(2).tolist()) == sorted(first)
    allocator.check_invariants()


def test_out_of_blocks_changes_nothing():
    allocator = BlockAllocator(4)
    allocator.allocate(3)
    before = (allocator.ref_count.copy(), allocator.free_block_ids())
    with pytest.raises(OutOfBlocksError):
        allocator.allocate(2)
    assert np.array_equal(before[0], allocator.ref_count)
    assert np.array_equal(before[1], allocator.free_block_ids())


def test_shared_block_is_freed_only_at_zero():
    allocator = BlockAllocator(4)
    block = allocator.allocate_one()
    allocator.incref(np.array([block]), times=2)
    assert allocator.ref_count[block] == 3
    assert allocator.num_shared_blocks == 1
    assert allocator.decref(np.array([block])) == 0
    allocator.check_invariants()
    assert allocator.decref(np.array([block, block])) == 1
    assert allocator.num_shared_blocks == 0
    assert allocator.num_free_blocks == 4
    allocator.check_invariants()


def test_decref_with_repeated_ids_counts_each():
    allocator = BlockAllocator(3)
    blocks = allocator.allocate(2)
    allocator.incref(blocks)
    freed = allocator.decref(np.concatenate([blocks, blocks[:1]]))
    assert freed == 1 and allocator.ref_count[blocks[1]] == 1
    allocator.check_invariants()


def test_fresh_pool_hands_out_block_zero_first():
    assert BlockAllocator(5).allocate_one() == 0


def _set_free_stack_entry(allocator: BlockAllocator, index: int, block_id: int) -> None:
    allocator._free_stack[index] = block_id


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda a: setattr(a, "num_free_blocks", 5), r"num_free_blocks 5 outside \[0, 4\]"),
        (lambda a: a.ref_count_padded.__setitem__(4, 1), "the padding ref count slot was written"),
        (lambda a: setattr(a, "num_shared_blocks", 1), "num_shared_blocks=1 but 0 blocks are shared"),
        (lambda a: a.ref_count.__setitem__(0, -1), r"negative ref counts at blocks \[0\]"),
        (lambda a: _set_free_stack_entry(a, 1, 3), "a block is on the free list twice"),
        (lambda a: a.ref_count.__setitem__(3, 1), "free list iff its ref count is 0"),  # in use, still on the list
    ],
)
def test_each_check_of_check_invariants_fires(corrupt, message):
    allocator = BlockAllocator(4)
    allocator.allocate(2)  # blocks 0 and 1 in use; 3 and 2 on the free list
    allocator.check_invariants()
    corrupt(allocator)
    with pytest.raises(InvariantViolationError, match=message):
        allocator.check_invariants()


def test_zero_blocks_rejected():
    with pytest.raises(InvalidArgumentError):
        BlockAllocator(0)
