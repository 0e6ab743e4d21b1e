import numpy as np
import pytest

from kvpool_server.core import (
    FailedPreconditionError,
    InvalidArgumentError,
    KVCacheManager,
    OutOfBlocksError,
    SequenceExistsError,
    SequenceNotFoundError,
)

from .conftest import run_copies, tag_memory


def test_append_returns_slots_through_the_block_table(manager):
    seq = manager.register()
    plan = manager.append([seq], 6)
    table = manager.block_table(seq)
    assert table.size == 2 and plan.new_block_ids.tolist() == table.tolist()
    expected = [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert plan.slot_mapping.tolist() == expected
    plan = manager.append(seq)
    assert plan.slot_mapping.tolist() == [table[1] * 4 + 2] and plan.new_block_ids.size == 0
    assert manager.num_tokens(seq) == 7
    manager.check_invariants()


def test_per_sequence_and_batched_paths_agree():
    a, b = KVCacheManager(64, 4), KVCacheManager(64, 4)
    ids_a = [a.register() for _ in range(5)]
    ids_b = [b.register() for _ in range(5)]
    rng = np.random.default_rng(0)
    for _ in range(30):
        chosen = sorted(rng.choice(5, size=rng.integers(1, 6), replace=False).tolist())
        slots_a = np.concatenate([a.append(ids_a[i]).slot_mapping for i in chosen])
        slots_b = b.append([ids_b[i] for i in chosen]).slot_mapping
        assert slots_a.tolist() == slots_b.tolist()
    a.check_invariants()
    b.check_invariants()


def test_batch_slots_grouped_by_sequence_in_request_order(manager):
    s1, s2 = manager.register(), manager.register()
    manager.append([s1], 3)
    plan = manager.append([s2, s1], [2, 3])
    slots = plan.slot_mapping.tolist()
    assert slots[:2] == manager.slots(s2, 0, 2).tolist()
    assert slots[2:] == manager.slots(s1, 3, 3).tolist()


def test_batch_is_all_or_nothing_on_exhaustion(manager, assert_unchanged):
    seqs = [manager.register() for _ in range(3)]
    manager.append(seqs, 16)  # 12 of 16 blocks
    with assert_unchanged(manager), pytest.raises(OutOfBlocksError):
        manager.append(seqs, [4, 4, 12])  # needs 1 + 1 + 3 > 4 free
    plan = manager.append(seqs, [4, 4, 4])  # exactly 3 more blocks... and 1 left
    assert plan.new_block_ids.size == 3
    manager.check_invariants()


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda m, s: m.append([s, 999]), SequenceNotFoundError),
        (lambda m, s: m.append([s, s + 1]), SequenceNotFoundError),
        (lambda m, s: m.append([s, 0]), SequenceNotFoundError),
        (lambda m, s: m.append([s, s]), InvalidArgumentError),
        (lambda m, s: m.append([]), InvalidArgumentError),
        (lambda m, s: m.append([s], 0), InvalidArgumentError),
        (lambda m, s: m.append([s], -3), InvalidArgumentError),
        (lambda m, s: m.append([s], [1, 2]), InvalidArgumentError),
        (lambda m, s: m.append([s], 41), InvalidArgumentError),  # over max_seq_len
        (lambda m, s: m.append([s], 2**40), InvalidArgumentError),
        (lambda m, s: m.append(999), SequenceNotFoundError),
        (lambda m, s: m.register(s), SequenceExistsError),
        (lambda m, s: m.register(0), InvalidArgumentError),
        (lambda m, s: m.fork(999, 1), SequenceNotFoundError),
        (lambda m, s: m.fork(s, 0), InvalidArgumentError),
        (lambda m, s: m.fork(s, 0, [s]), SequenceExistsError),
        (lambda m, s: m.fork(s, 2, [77]), InvalidArgumentError),
        (lambda m, s: m.fork(s, 0, [77, 77]), InvalidArgumentError),
        (lambda m, s: m.free([s, s]), InvalidArgumentError),
        (lambda m, s: m.free([s, 999]), SequenceNotFoundError),
        (lambda m, s: m.free([]), InvalidArgumentError),
        (lambda m, s: m.slots(s, 2, 5), InvalidArgumentError),
        (lambda m, s: m.slots(s, -1, 1), InvalidArgumentError),
        (lambda m, s: m.slots(s, 5, 1), InvalidArgumentError),
    ],
)
def test_errors_change_nothing(manager, assert_unchanged, call, error):
    seq = manager.register()
    manager.append([seq], 5)
    manager.fork(seq, 1)
    with assert_unchanged(manager), pytest.raises(error):
        call(manager, seq)


def test_append_at_max_seq_len_is_invalid(assert_unchanged):
    manager = KVCacheManager(num_blocks=8, block_size=4, max_seq_len=8)
    seq = manager.register()
    manager.append([seq], 8)
    with assert_unchanged(manager), pytest.raises(InvalidArgumentError, match="max_seq_len=8"):
        manager.append(seq)
    with assert_unchanged(manager), pytest.raises(InvalidArgumentError):
        manager.append([seq])


def test_fork_shares_blocks_and_counts_refs(manager):
    parent = manager.register()
    manager.append([parent], 6)
    children = manager.fork(parent, 3)
    assert len(set(children)) == 3 and parent not in children
    for child in children:
        assert manager.block_table(child).tolist() == manager.block_table(parent).tolist()
        assert manager.num_tokens(child) == 6
    assert (manager.allocator.ref_count[manager.block_table(parent)] == 4).all()
    stats = manager.stats()
    assert stats.num_blocks_used == 2 and stats.num_blocks_shared == 2 and stats.num_tokens == 24
    manager.check_invariants()


def test_copy_on_write_of_partial_last_block_keeps_each_sides_data(manager):
    memory = tag_memory(manager)
    parent = manager.register()
    plan = manager.append([parent], 6)
    memory[plan.slot_mapping] = [100 + p for p in range(6)]
    (child,) = manager.fork(parent, 1)
    plan = manager.append(child)  # writes into the shared partial block: copy first
    assert plan.copies.shape == (1, 2)
    src, dst = plan.copies[0].tolist()
    assert src == manager.block_table(parent)[1] and dst == manager.block_table(child)[1]
    run_copies(memory, plan.copies, 4)
    memory[plan.slot_mapping] = 999
    plan = manager.append(parent)  # parent is sole owner again: no copy
    assert plan.copies.size == 0
    memory[plan.slot_mapping] = 106
    read = lambda s: memory[manager.slots(s, 0, manager.num_tokens(s))].tolist()  # noqa: E731
    assert read(parent) == [100, 101, 102, 103, 104, 105, 106]
    assert read(child) == [100, 101, 102, 103, 104, 105, 999]
    assert manager.block_table(parent)[0] == manager.block_table(child)[0]  # full block still shared
    assert manager.stats().num_copies == 1
    manager.check_invariants()


def test_full_shared_block_needs_no_copy(manager):
    parent = manager.register()
    manager.append([parent], 8)
    (child,) = manager.fork(parent, 1)
    plan = manager.append([parent, child])
    assert plan.copies.size == 0 and plan.new_block_ids.size == 2
    manager.check_invariants()


def test_k_sharers_appending_together_make_k_minus_1_copies(manager):
    parent = manager.register()
    manager.append([parent], 5)
    beams = [parent, *manager.fork(parent, 3)]
    plan = manager.append(beams)
    assert plan.copies.shape[0] == 3
    assert len({int(manager.block_table(b)[1]) for b in beams}) == 4
    assert manager.stats().num_blocks_shared == 1  # the full first block
    manager.check_invariants()


def test_some_sharers_appending_all_copy(manager):
    parent = manager.register()
    manager.append([parent], 5)
    beams = [parent, *manager.fork(parent, 3)]
    plan = manager.append(beams[1:3])
    assert plan.copies.shape[0] == 2
    assert manager.allocator.ref_count[manager.block_table(parent)[1]] == 2
    manager.check_invariants()


def test_copy_on_write_counts_against_free_blocks(assert_unchanged):
    manager = KVCacheManager(num_blocks=2, block_size=4)
    parent = manager.register()
    manager.append([parent], 6)
    (child,) = manager.fork(parent, 1)
    with assert_unchanged(manager), pytest.raises(OutOfBlocksError):
        manager.append(child)


def test_free_returns_blocks_at_refcount_zero(manager):
    parent = manager.register()
    manager.append([parent], 9)
    (child,) = manager.fork(parent, 1)
    assert manager.free(parent) == 0
    assert manager.stats().num_blocks_used == 3
    assert manager.free([child]) == 3
    stats = manager.stats()
    assert stats.num_blocks_free == 16 and stats.num_sequences == 0 and stats.num_tokens == 0
    with pytest.raises(SequenceNotFoundError):
        manager.free(child)
    manager.check_invariants()


def test_freed_blocks_are_reusable_at_once(manager):
    seqs = [manager.register() for _ in range(4)]
    manager.append(seqs, 16)
    other = manager.register()
    with pytest.raises(OutOfBlocksError):
        manager.append(other)
    manager.free(seqs[0])
    assert manager.append([other], 16).new_block_ids.size == 4


def test_slots_for_write_refuses_shared_blocks(manager):
    parent = manager.register()
    manager.append([parent], 6)
    (child,) = manager.fork(parent, 1)
    with pytest.raises(FailedPreconditionError, match="shared"):
        manager.slots(child, 5, 1, for_write=True)
    manager.append(child)  # copy-on-write of the last block
    assert manager.slots(child, 4, 3, for_write=True).size == 3
    with pytest.raises(FailedPreconditionError):
        manager.slots(child, 0, 1, for_write=True)


def test_a_slot_is_block_times_block_size_plus_offset(manager):
    seq = manager.register()
    manager.append([seq], 7)
    (slot,) = manager.slots(seq, 5, 1).tolist()
    assert slot == manager.block_table(seq)[1] * 4 + 1


def test_stats_internal_fragmentation_counts_each_block_once(manager):
    a = manager.register()
    manager.append([a], 5)  # 2 blocks, 3 unused slots
    manager.fork(a, 2)  # shares both blocks: still 3 unused slots
    b = manager.register()
    manager.append([b], 4)  # full block
    stats = manager.stats()
    assert (stats.num_blocks_used, stats.num_slots_unused) == (3, 3)
    assert stats.internal_fragmentation == pytest.approx(3 / 12)
    assert stats.utilization == pytest.approx(3 / 16)
    assert stats.num_tokens == 19 and stats.num_sequences == 4


def test_caller_ids_and_server_ids_mix(manager):
    assert manager.register(1) == 1
    server_id = manager.register()
    assert server_id != 1
    assert manager.fork(1, 0, [2**64 - 2, 2**63]) == [2**64 - 2, 2**63]
    plan = manager.append(np.array([2**64 - 2, server_id, 1, 2**63], dtype=np.uint64))
    assert plan.num_new_tokens == 4
    for bad in (0, 2**64 - 1, 2**64):
        with pytest.raises(InvalidArgumentError):
            manager.register(bad)


def test_id_zero_never_reaches_a_free_row(assert_unchanged):
    manager = KVCacheManager(num_blocks=8, block_size=4)
    first, second = manager.register(), manager.register()
    manager.free(first)  # its row (0) is free now
    with assert_unchanged(manager), pytest.raises(SequenceNotFoundError, match="sequence 0"):
        manager.append([0])
    with assert_unchanged(manager), pytest.raises(SequenceNotFoundError):
        manager.append([second, 0])


def test_too_many_sequences_is_resource_exhausted(assert_unchanged):
    manager = KVCacheManager(num_blocks=4, block_size=4, max_num_seqs=2)
    seq = manager.register()
    with assert_unchanged(manager), pytest.raises(OutOfBlocksError, match="max_num_seqs"):
        manager.fork(seq, 2)
    manager.register()
    with assert_unchanged(manager), pytest.raises(OutOfBlocksError):
        manager.register()


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_decode_steps_write_the_slots_the_tables_name(block_size):
    """The decode planner reads cached next slots; every slot must still be block * block_size + offset."""
    manager = KVCacheManager(num_blocks=200, block_size=block_size, max_seq_len=64)
    seqs = [manager.register() for _ in range(5)]
    for i, seq in enumerate(seqs):
        if i:  # one sequence starts empty, the others at different offsets
            manager.append(seq, i * 2 + 1)
    child = manager.fork(seqs[2], 1)[0]  # shared blocks send a step through copy-on-write first
    seqs.append(child)
    for _ in range(3 * block_size + 2):
        before = {seq: manager.num_tokens(seq) for seq in seqs}
        plan = manager.append(seqs)
        for seq, slot in zip(seqs, plan.slot_mapping.tolist()):
            position = before[seq]
            table = manager.block_table(seq)
            assert slot == table[position // block_size] * block_size + position % block_size
        manager.check_invariants()


@pytest.mark.parametrize("counts", [[4], [3], [1, 3], [2, 2], [1, 1, 2, 5], [7], [4, 4, 1], [2, 6, 1]])
def test_multi_token_appends_to_one_sequence_match_the_table(counts):
    """``append(seq, n)``: within one block (a range of slots, new block or not) and across blocks alike."""
    manager = KVCacheManager(num_blocks=32, block_size=4, max_seq_len=40)
    other = manager.register()
    seq = manager.register()
    for count in counts:
        manager.append(other, 3)  # interleave, so that a sequence's blocks are not consecutive
        before = manager.num_tokens(seq)
        plan = manager.append(seq, count)
        table = manager.block_table(seq)
        expected = [table[p // 4] * 4 + p % 4 for p in range(before, before + count)]
        assert plan.slot_mapping.tolist() == expected and plan.slot_mapping.dtype == np.int64
        assert sorted(plan.new_block_ids.tolist()) == sorted(set(table.tolist()) - set(table[: -(-before // 4)].tolist()))
        manager.check_invariants()
