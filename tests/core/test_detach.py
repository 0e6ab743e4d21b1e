"""Free in two halves (``detach`` then ``release_detached`` in parts: what a chunked Free does between lock holds),
and the token chains a fork's children share: the pool is consistent at every step, and the end state is a plain
free's."""

from __future__ import annotations

import pytest

from kvpool_server.core import InvalidArgumentError, KVCacheManager, SequenceNotFoundError
from kvpool_server.core.block_hash import chain_hashes

BS = 4
SYSTEM = list(range(200, 208))  # two public blocks
PROMPT = SYSTEM + [1, 2, 3, 4, 5]


def family(manager: KVCacheManager, tenant: int, children: int) -> list[int]:
    """A tracked sequence with a public prefix and its children (sharing its public and private blocks)."""
    seq = manager.register(tenant=tenant, prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM))
    done = manager.num_tokens(seq, tenant)
    manager.append(seq, len(PROMPT) - done, tenant=tenant, token_ids=PROMPT[done:])
    manager.append(seq, 1, tenant=tenant, token_ids=[9])  # seals the full blocks: the first two public
    return [seq, *manager.fork(seq, children, tenant=tenant)]


def test_a_free_detached_then_released_in_parts_ends_where_a_free_ends() -> None:
    states = []
    for in_parts in (False, True):
        manager = KVCacheManager(num_blocks=64, block_size=BS, tenancy=True)
        a, b = manager.tenants.tenant_id("a"), manager.tenants.tenant_id("b")
        ids_a, ids_b = family(manager, a, 5), family(manager, b, 2)
        doomed = {a: ids_a[1:], b: ids_b[:1]}  # a's parent and b's children stay
        if in_parts:
            rows = [row for tenant, ids in doomed.items() for row in manager.detach(ids, tenant)]
            manager.check_invariants()
            for tenant, ids in doomed.items():
                for seq_id in ids:
                    with pytest.raises(SequenceNotFoundError):
                        manager.num_tokens(seq_id, tenant)
            assert manager.num_sequences == 3 and manager.detached_rows == set(rows)
            freed = 0
            for part in (rows[:2], rows[2:3], rows[3:]):  # the last part mixes the two tenants' rows
                freed += manager.release_detached(part)
                manager.check_invariants()
            assert not manager.detached_rows
        else:
            freed = sum(manager.free(ids, tenant) for tenant, ids in doomed.items())
        manager.check_invariants()
        states.append((freed, manager.stats(), list(manager.tenants.num_blocks), dict(manager.tenants.public_refs)))
    assert states[0] == states[1]


def test_a_detach_that_fails_changes_nothing() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    seq = manager.register()
    manager.append(seq, 9)
    with pytest.raises(InvalidArgumentError):
        manager.detach([seq, seq])
    with pytest.raises(SequenceNotFoundError):
        manager.detach([seq, seq + 1])
    assert manager.num_tokens(seq) == 9 and not manager.detached_rows
    manager.check_invariants()


def test_children_share_their_parents_pending_blocks_and_the_first_to_append_seals_them_for_all() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    parent = manager.register()
    manager.append(parent, 10, token_ids=list(range(10)))  # two full blocks pending, two tokens partial
    children = manager.fork(parent, 3)
    chains = [manager.chains.chains[manager.index.row(s)] for s in (parent, *children)]
    assert len({id(c) for c in chains}) == 4 and len({id(c.pending) for c in chains}) == 1
    assert manager.allocator.cache.num_cached == 0  # not sealed by the fork
    manager.allocator.cache.events = stored = []  # every entry stored, in order
    manager.append(children[1], 2, token_ids=[50, 51])  # seals the shared two for everyone; fills block 2
    assert manager.allocator.cache.num_cached == 2 and manager.allocator.cache.is_cached[
        manager.block_table(parent)[:2]].all()
    manager.append([parent, *children], 1, token_ids=[60, 61, 62, 63])  # the rest seal nothing new
    assert manager.allocator.cache.num_cached == 3  # child 1's third block, sealed by its second append
    assert len(stored) == 3 and len({e.block_hash for e in stored}) == 3  # each block stored (an event) once
    manager.check_invariants()
    expected = chain_hashes(list(range(10)) + [50, 51], BS, b"")
    assert [manager.allocator.cache.entries[b].block_hash for b in manager.block_table(children[1])[:3]] == expected
    probe = manager.register(prompt_token_ids=list(range(10)) + [50, 51, 70])
    assert manager.num_tokens(probe) == 12  # the shared blocks and the child's own match


def test_a_shared_pending_block_that_lost_its_hash_to_another_block_is_not_sealed_by_the_other_sharers() -> None:
    """The first sharer to seal settles the shared blocks for all, whatever the cache answered: a block whose hash
    another block held then is not sealed later by another sharer, even once that other block is gone."""
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    manager.allocator.cache.events = stored = []
    tokens = list(range(BS))
    first = manager.register()
    manager.append(first, BS + 1, token_ids=tokens + [99])  # block 0 hashed; sealed by the next append
    manager.append(first, 1, token_ids=[98])
    assert len(stored) == 1
    parent = manager.register()
    manager.append(parent, BS + 1, token_ids=tokens + [97])  # the same first block, in a block of its own
    children = manager.fork(parent, 1)
    manager.append(parent, 1, token_ids=[96])  # seals for both sharers: the hash is taken, nothing stored
    assert len(stored) == 1
    manager.free(first)  # its blocks go idle; taking every free block evicts them
    filler = manager.register()
    manager.append(filler, manager.allocator.num_allocatable * BS)
    assert not manager.allocator.cache.num_cached
    manager.append(children[0], 1, token_ids=[95])  # the other sharer's next append seals nothing
    assert [type(e).__name__ for e in stored] == ["CachedBlock", "BlockRemoved"]
    assert not manager.allocator.cache.num_cached
    manager.check_invariants()
