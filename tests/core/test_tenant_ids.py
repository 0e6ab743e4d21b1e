"""Sequence ids are per tenant with tenancy on (docs/security.md, "Sequence ids"): a caller-chosen id is refused
only when the caller's own tenant holds it, two tenants' equal ids are two sequences, and a tenant's server ids
are a function of its own calls alone."""

import numpy as np
import pytest

from kvpool_server.core import (
    InvalidArgumentError,
    InvariantViolationError,
    KVCacheManager,
    SequenceExistsError,
    SequenceNotFoundError,
)
from kvpool_server.core import listings
from kvpool_server.core.tenant_ids import MIN_SLOTS
from tests.core.conftest import snapshot


def tenancy(**kwargs) -> tuple[KVCacheManager, int, int]:
    manager = KVCacheManager(num_blocks=256, block_size=4, tenancy=True, **kwargs)
    return manager, manager.tenants.tenant_id("a"), manager.tenants.tenant_id("b")


def test_two_tenants_both_register_caller_chosen_id_7_as_two_sequences() -> None:
    manager, a, b = tenancy()
    assert manager.register(7, tenant=a) == 7
    assert manager.register(7, tenant=b) == 7  # not ALREADY_EXISTS: a's 7 is invisible to b
    manager.append(7, 9, tenant=a)
    assert (manager.num_tokens(7, a), manager.num_tokens(7, b)) == (9, 0)
    assert not set(manager.block_table(7, a).tolist()) & set(manager.block_table(7, b).tolist())
    with pytest.raises(SequenceExistsError):
        manager.register(7, tenant=a)  # within a tenant, an id is taken
    manager.free(7, tenant=b)
    with pytest.raises(SequenceNotFoundError):
        manager.num_tokens(7, b)
    assert manager.num_tokens(7, a) == 9
    assert manager.register(7, tenant=b) == 7
    manager.check_invariants()


def test_fork_children_ids_collide_across_tenants_and_not_within_one() -> None:
    manager, a, b = tenancy()
    pa, pb = manager.register(tenant=a), manager.register(tenant=b)
    manager.append([pa], 5, tenant=a)
    assert manager.fork(pa, child_seq_ids=[11, 12], tenant=a) == [11, 12]
    assert manager.fork(pb, child_seq_ids=[12, 11], tenant=b) == [12, 11]
    with pytest.raises(SequenceExistsError):
        manager.fork(pb, child_seq_ids=[13, 11], tenant=b)
    with pytest.raises(SequenceExistsError):
        manager.register(12, tenant=a)
    assert (manager.num_tokens(12, a), manager.num_tokens(12, b)) == (5, 0)
    assert manager.tenants.num_sequences[a] == manager.tenants.num_sequences[b] == 3
    manager.check_invariants()


def test_a_refused_caller_chosen_id_changes_nothing() -> None:
    manager, a, b = tenancy()
    manager.register(7, tenant=a)
    parent = manager.register(tenant=a)
    before = snapshot(manager), manager.tenant_ids.id_of_row.tobytes()
    for call in (lambda: manager.register(7, tenant=a), lambda: manager.fork(parent, child_seq_ids=[8, 7], tenant=a),
                 lambda: manager.fork(parent, child_seq_ids=[8, 8], tenant=a)):
        with pytest.raises((SequenceExistsError, InvalidArgumentError)):
            call()
        assert (snapshot(manager), manager.tenant_ids.id_of_row.tobytes()) == before
    manager.check_invariants()


def a_calls(manager: KVCacheManager, a: int, b: int, others: bool) -> list[int]:
    """Tenant a registers, forks and frees, while b (when ``others``) registers, forks and frees between a's calls;
    returns every id a was given."""
    given = [manager.register(tenant=a), manager.register(tenant=a)]
    if others:
        bs = [manager.register(tenant=b) for _ in range(1000)]
        manager.free(bs[:500], tenant=b)
    given.append(manager.register(tenant=a))
    manager.free(given[1], tenant=a)
    if others:
        manager.fork(bs[600], 3, tenant=b)
        manager.register(tenant=b)
    given += manager.fork(given[0], 2, tenant=a)
    given.append(manager.register(tenant=a))
    return given


def test_a_tenants_server_ids_are_a_function_of_its_own_calls(monkeypatch) -> None:
    """Same random start for the tenants' counters (patched), two runs: b busy between a's calls or idle. a is
    given the very same ids, so they tell it nothing about b; and they count up by one from call to call."""
    monkeypatch.setattr("kvpool_server.core.tenant_ids.os.urandom", lambda n: bytes([5] * n))
    with_b = a_calls(*tenancy(max_num_seqs=2048), others=True)
    alone = a_calls(*tenancy(max_num_seqs=2048), others=False)
    assert with_b == alone
    slot_bits = KVCacheManager(1, 1, max_num_seqs=2048).index.row_bits
    serials = [seq_id >> slot_bits for seq_id in with_b]
    assert serials == list(range(serials[0], serials[0] + len(serials)))


def test_server_ids_of_a_tenant_never_name_a_shared_row() -> None:
    """The low bits of a tenant's server id are a slot of its own: b's 100 live sequences do not show in a's."""
    manager, a, b = tenancy()
    for _ in range(100):
        manager.register(tenant=b)
    first = manager.register(tenant=a)
    assert first & ((1 << manager.index.row_bits) - 1) == 0  # a's first slot, whatever row it holds


def test_a_batch_resolves_in_the_callers_namespace_fast_and_slow_paths() -> None:
    manager, a, b = tenancy(max_num_seqs=512)
    server = [manager.register(tenant=a) for _ in range(3 * MIN_SLOTS)]  # the slot arrays grow twice
    chosen = [manager.register(1000 + i, tenant=a) for i in range(3)]
    theirs = manager.register(tenant=b)
    plan = manager.append(server, 1, tenant=a)  # the fast path: slots
    assert plan.slot_mapping.size == len(server)
    plan = manager.append(np.array(server[:5] + chosen, dtype=np.uint64), [1] * 5 + [2] * 3, tenant=a)
    assert [manager.num_tokens(s, a) for s in server[:6] + chosen] == [2] * 5 + [1] + [2] * 3
    with pytest.raises(SequenceNotFoundError, match=str(theirs)):
        manager.append([server[0], theirs], 1, tenant=a)  # b's id in a's batch: unknown to a
    with pytest.raises(InvalidArgumentError, match="twice"):
        manager.append([server[0], chosen[0], server[0]], 1, tenant=a)
    with pytest.raises(SequenceNotFoundError):
        manager.append(theirs, 1, tenant=a)
    manager.free(server[::2], tenant=a)
    with pytest.raises(SequenceNotFoundError):
        manager.append(server[:2], 1, tenant=a)  # a freed id: its slot holds nothing, or another id
    manager.append(server[1::2], 1, tenant=a)
    manager.check_invariants()


def test_trusted_calls_name_sequences_by_internal_ids() -> None:
    """A session's end frees by seq_ids_of_session (internal ids, tenant=None); listings show the tenants' ids."""
    manager, a, b = tenancy()
    mine = manager.register(7, session_id=5, tenant=a)
    kids = manager.fork(mine, child_seq_ids=[8], tenant=a)  # the parent's session
    theirs = manager.register(7, session_id=6, tenant=b)
    internal = manager.seq_ids_of_session(5)
    assert len(internal) == 2 and 7 not in internal and 8 not in internal
    assert [(i[0], i[1]) for i in listings.sequence_infos(manager, 5)] == [(7, 5), (8, 5)]
    assert [i[0] for i in listings.sequence_infos(manager, tenant=b)] == [theirs]
    assert [i[0] for i in listings.sequence_infos(manager)] == [7, 7, 8]
    assert manager.free(internal) == 0
    assert manager.seq_ids_of_session(5) == [] and manager.tenants.num_sequences[a] == 0
    with pytest.raises(SequenceNotFoundError):
        manager.num_tokens(kids[0], a)
    assert manager.num_tokens(7, b) == 0  # b's 7 is untouched
    manager.check_invariants()


def test_without_tenancy_ids_are_one_namespace_as_before() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    assert manager.register(7, tenant=3) == 7
    with pytest.raises(SequenceExistsError):
        manager.register(7)
    server_id = manager.register()
    assert manager.index.row(server_id) == server_id & ((1 << manager.index.row_bits) - 1)  # the row in its bits
    assert manager.seq_ids_of_session(0) == []
    assert [i[0] for i in listings.sequence_infos(manager)] == sorted([7, server_id])
    manager.check_invariants()


def test_check_invariants_fires_on_a_namespace_that_disagrees() -> None:
    manager, a, b = tenancy()
    seq = manager.register(tenant=a)
    manager.register(9, tenant=b)
    manager.check_invariants()
    space = manager.tenant_ids.spaces[a]
    space.slot_to_id[0] += np.uint64(1 << manager.index.row_bits)
    with pytest.raises(InvariantViolationError, match="slots"):
        manager.check_invariants()
    space.slot_to_id[0] -= np.uint64(1 << manager.index.row_bits)
    row = manager.tenant_ids.row(b, 9)
    manager.tenant_ids.spaces[b].row_of[9] = manager.tenant_ids.row(a, seq)  # b's 9 names a's row
    with pytest.raises(InvariantViolationError, match="namespaces"):
        manager.check_invariants()
    manager.tenant_ids.spaces[b].row_of[9] = row
    manager.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_random_calls_of_three_tenants_match_a_model_of_separate_namespaces(seed: int) -> None:
    """Register (chosen ids from a small range, so they collide across tenants), fork, append, free, at random; the
    model is one dict per tenant, id -> tokens. Every answer and every tenant's view must match it."""
    rng = np.random.default_rng(seed)
    manager = KVCacheManager(num_blocks=512, block_size=4, max_num_seqs=128, tenancy=True)
    tenants = [manager.tenants.tenant_id(name) for name in "abc"]
    model: dict[int, dict[int, int]] = {t: {} for t in tenants}
    for _ in range(400):
        t = int(rng.choice(tenants))
        mine, op = model[t], rng.integers(5)
        chosen = int(rng.integers(1, 12))
        if op == 0 and sum(map(len, model.values())) < 120:
            if chosen in mine:
                with pytest.raises(SequenceExistsError):
                    manager.register(chosen, tenant=t)
            else:
                assert manager.register(chosen, tenant=t) == chosen
                mine[chosen] = 0
        elif op == 1 and sum(map(len, model.values())) < 120:
            seq_id = manager.register(tenant=t)
            assert seq_id not in mine
            mine[seq_id] = 0
        elif op == 2 and mine:
            parent = int(rng.choice(list(mine)))
            kids = manager.fork(parent, child_seq_ids=[] if chosen in mine else [chosen], num_children=1, tenant=t)
            assert len(kids) == 1 and kids[0] not in mine
            mine[kids[0]] = mine[parent]
        elif op == 3 and mine:
            batch = [int(s) for s in rng.permutation(list(mine))[: int(rng.integers(1, len(mine) + 1))]]
            manager.append(batch, 2, tenant=t)
            for seq_id in batch:
                mine[seq_id] += 2
        elif op == 4 and mine:
            victim = int(rng.choice(list(mine)))
            manager.free(victim, tenant=t)
            del mine[victim]
        for u in tenants:
            assert {i[0]: i[2] for i in listings.sequence_infos(manager, tenant=u)} == model[u]
        manager.check_invariants()
