"""benchmarks/persistent_batch.py: bench_core's persistent decode batch steps exactly as ``manager.append`` does."""

import numpy as np
import pytest

from benchmarks.persistent_batch import SequenceBatch
from kvpool_server.core import InvalidArgumentError, KVCacheManager, OutOfBlocksError, SequenceNotFoundError
from tests.core.conftest import snapshot


def test_step_matches_append():
    stepped, direct = KVCacheManager(64, 4), KVCacheManager(64, 4)
    batch = SequenceBatch(stepped)
    ids_direct = []
    for n in (3, 4, 9):
        seq_id = stepped.register()
        stepped.append(seq_id, n)
        batch.add(seq_id)
        ids_direct.append(direct.register())
        direct.append(ids_direct[-1], n)
    for _ in range(6):
        assert batch.step().slot_mapping.tolist() == direct.append(ids_direct).slot_mapping.tolist()
    stepped.check_invariants()


def test_replace_and_remove_keep_rows_right():
    manager = KVCacheManager(64, 4)
    batch = SequenceBatch(manager)
    a, b, c = (manager.register() for _ in range(3))
    for seq_id in (a, b, c):
        batch.add(seq_id)
    manager.free(b)
    d = manager.register()
    batch.replace(b, d)
    batch.remove(a)
    plan = batch.step()
    assert batch.seq_ids.tolist() == [c, d]  # the last member moved into a's place
    assert plan.slot_mapping.tolist() == [*manager.slots(c, 0, 1), *manager.slots(d, 0, 1)]
    with pytest.raises(InvalidArgumentError):
        batch.add(c)


def test_member_freed_behind_the_batch_is_refused_and_nothing_changes():
    manager = KVCacheManager(64, 4)
    batch = SequenceBatch(manager)
    a, b = manager.register(), manager.register()
    batch.add(a)
    batch.add(b)
    manager.free(a)
    manager.register()  # may reuse a's row
    before = snapshot(manager)
    with pytest.raises(SequenceNotFoundError, match=str(a)):
        batch.step()
    assert snapshot(manager) == before


def test_step_copies_on_write():
    manager = KVCacheManager(3, 4)
    batch = SequenceBatch(manager)
    parent = manager.register()
    manager.append(parent, 5)
    (child,) = manager.fork(parent, 1)
    batch.add(parent)
    batch.add(child)
    plan = batch.step()
    assert plan.copies.shape == (1, 2) and manager.num_copies == 1
    assert manager.block_table(parent)[1] != manager.block_table(child)[1]
    manager.check_invariants()


def test_step_out_of_blocks_changes_nothing():
    manager = KVCacheManager(2, 4)
    batch = SequenceBatch(manager)
    a, b = manager.register(), manager.register()
    manager.append(a, 4)
    manager.append(b, 4)
    batch.add(a)
    batch.add(b)
    before = snapshot(manager)
    with pytest.raises(OutOfBlocksError):
        batch.step()
    assert snapshot(manager) == before
    assert np.array_equal(batch.seq_ids, np.array([a, b], dtype=np.uint64))


def test_empty_batch_is_invalid():
    with pytest.raises(InvalidArgumentError):
        SequenceBatch(KVCacheManager(4, 4)).step()


def test_step_with_token_ids_caches_as_append_does():
    # Prefix caching: the batch's steps carry the members' tokens into their chains, exactly as manager.append does,
    # so that a new sequence with the same prompt and output finds the same blocks cached.
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 1000, size=n, dtype=np.uint32) for n in (3, 4, 9)]
    outputs = rng.integers(0, 1000, size=(7, 3), dtype=np.uint32)
    stepped, direct = KVCacheManager(64, 4), KVCacheManager(64, 4)
    ids = {}
    for name, manager in (("stepped", stepped), ("direct", direct)):
        ids[name] = np.array([manager.register(prompt_token_ids=p) for p in prompts], dtype=np.uint64)
        manager.append(ids[name], [p.size for p in prompts], token_ids=np.concatenate(prompts))
    batch = SequenceBatch(stepped)
    batch.extend(ids["stepped"])
    for tokens in outputs:
        plan = batch.step(tokens)
        assert plan.slot_mapping.tolist() == direct.append(ids["direct"], token_ids=tokens).slot_mapping.tolist()
    for name, manager in (("stepped", stepped), ("direct", direct)):  # the ids differ (server-assigned)
        ids[name] = [(manager.num_tokens(s), manager.block_table(s).tolist()) for s in ids[name].tolist()]
    assert ids["stepped"] == ids["direct"]
    assert np.array_equal(stepped.allocator.ref_count, direct.allocator.ref_count)
    assert stepped.allocator.cache.block_of_hash == direct.allocator.cache.block_of_hash
    assert stepped.allocator.cache.num_cached > 0
    stepped.check_invariants()
    full = np.concatenate([prompts[2], outputs[:, 2]])  # 16 tokens: 3 full blocks cached, the 4th left to compute
    again = stepped.register(prompt_token_ids=full)
    assert stepped.num_tokens(again) == 12


def test_extend_adds_members_in_order_and_refuses_repeats():
    manager = KVCacheManager(64, 4)
    batch = SequenceBatch(manager)
    a, b, c = (manager.register() for _ in range(3))
    batch.add(a)
    batch.extend(np.array([b, c], dtype=np.uint64))
    assert batch.seq_ids.tolist() == [a, b, c] and len(batch) == 3
    assert batch.rows.tolist() == [manager.index.row(s) for s in (a, b, c)]
    assert batch.step().slot_mapping.tolist() == [*manager.slots(a, 0, 1), *manager.slots(b, 0, 1), *manager.slots(c, 0, 1)]
    with pytest.raises(InvalidArgumentError):
        batch.extend(np.array([c], dtype=np.uint64))
    assert len(batch) == 3
