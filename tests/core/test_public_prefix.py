"""Public prefixes and extra keys in the core (docs/prefix-caching.md): a prefix registered as public is shared by
tenants, each charged for the shared blocks it holds; different salts or extra keys never share; quotas cut a
match short; bad arguments change nothing; a corrupting test for each changed invariant."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.core import InvalidArgumentError, InvariantViolationError, KVCacheManager
from kvpool_server.core.block_hash import MAX_EXTRA_KEY_BYTES, PUBLIC_SALT, block_hash, chain_hashes
from kvpool_server.core.checks import check_tenants
from kvpool_server.core.tenants import TenantLimits

from .conftest import snapshot, tag_memory

BS = 4
SYSTEM = list(range(200, 208))  # two full blocks: the public system prompt
PROMPT = SYSTEM + [1, 2, 3, 4, 5]  # then a tenant's own block and one more token

# The documented test vector (docs/prefix-caching.md): tokens 0..7, block size 4, public prefix of 4 tokens,
# tenant "acme", extra key b"lora:sql": the second block (acme's, chained from the public one).
GOLD_PUBLIC_THEN_ACME = "1f9c7dee59c29c96fbb779f1d16c16b9f784b338c15b49ced9671d4d5782b4ba"


def tenancy() -> tuple[KVCacheManager, int, int]:
    manager = KVCacheManager(num_blocks=32, block_size=BS, tenancy=True)
    return manager, manager.tenants.tenant_id("a"), manager.tenants.tenant_id("b")


def prefill(manager: KVCacheManager, tenant: int, prompt=PROMPT, public: int = len(SYSTEM), extra: bytes = b"",
            memory: np.ndarray | None = None) -> int:
    """Register with the prompt (its first ``public`` tokens public), append the rest with ids (writing tags into
    ``memory``), then one decode step, which seals the full blocks."""
    seq = manager.register(tenant=tenant, prompt_token_ids=prompt, public_prefix_len=public, cache_extra_key=extra)
    done = manager.num_tokens(seq, tenant)
    plan = manager.append(seq, len(prompt) - done, tenant=tenant, token_ids=prompt[done:])
    if memory is not None:
        memory[plan.slot_mapping] = np.arange(done, len(prompt)) + 1000 * (tenant + 1)
    manager.append(seq, 1, tenant=tenant, token_ids=[9])
    return seq


def test_the_hash_of_a_public_prefix_matches_the_documented_vector() -> None:
    first = block_hash(bytes(32), range(4), PUBLIC_SALT, b"lora:sql")
    second = block_hash(first, range(4, 8), b"acme", b"lora:sql")
    assert chain_hashes(range(8), 4, b"acme", extra=b"lora:sql", num_public=1) == [first, second]
    assert second.hex() == GOLD_PUBLIC_THEN_ACME


def test_tenants_share_a_public_prefix_and_each_is_charged_for_it() -> None:
    manager, a, b = tenancy()
    memory = tag_memory(manager)
    seq_a = prefill(manager, a, memory=memory)
    public_blocks = manager.block_table(seq_a, a)[:2]
    assert manager.allocator.cache.is_public[public_blocks].all()
    assert not manager.allocator.cache.is_public[manager.block_table(seq_a, a)[2]]  # a's own block: a's salt

    seq_b = manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM))
    assert manager.num_tokens(seq_b, b) == len(SYSTEM)  # the public blocks, not a's own third block
    assert np.array_equal(manager.block_table(seq_b, b), public_blocks)  # the same physical blocks
    assert memory[manager.slots(seq_b, 0, len(SYSTEM), tenant=b)].tolist() == list(range(1000 * (a + 1), 1000 * (a + 1) + 8))
    assert manager.allocator.ref_count[public_blocks].tolist() == [2, 2]
    assert (manager.tenants.num_blocks[a], manager.tenants.num_blocks[b]) == (4, 2)
    manager.check_invariants()

    children = manager.fork(seq_b, 2, tenant=b)  # b's children hold them too: b is not charged twice
    assert manager.tenants.num_blocks[b] == 2 and manager.tenants.public_refs[(b, int(public_blocks[0]))] == 3
    manager.free(seq_a, tenant=a)  # a keeps nothing; the public blocks stay, held by b
    assert manager.tenants.num_blocks[a] == 0 and manager.tenants.num_blocks[b] == 2
    assert manager.allocator.ref_count[public_blocks].tolist() == [3, 3]
    manager.check_invariants()
    manager.free([seq_b, *children], tenant=b)
    assert manager.tenants.num_blocks == [0, 0, 0] and manager.tenants.public_refs == {}
    assert manager.stats().num_blocks_evictable == 3  # two public blocks and a's own, still matchable
    manager.check_invariants()
    seq_a2 = manager.register(tenant=a, prompt_token_ids=PROMPT, public_prefix_len=len(SYSTEM))
    assert manager.num_tokens(seq_a2, a) == 12 and manager.tenants.num_blocks[a] == 3  # revived, charged again
    manager.check_invariants()


def test_without_a_public_prefix_tenants_never_share() -> None:
    manager, a, b = tenancy()
    prefill(manager, a)  # a published SYSTEM as public
    assert manager.num_tokens(manager.register(tenant=b, prompt_token_ids=PROMPT), b) == 0  # b's salt: no match
    prefill(manager, a, public=0)  # the same tokens under a's salt are other blocks
    assert manager.num_tokens(manager.register(tenant=b, prompt_token_ids=PROMPT), b) == 0
    assert manager.num_tokens(manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=4), b) == 4
    manager.check_invariants()


def test_a_public_prefix_is_its_own_namespace_without_tenancy() -> None:
    """PUBLIC_SALT is no tenant's salt, not even tenant 0's empty one: public and private blocks never alias."""
    manager = KVCacheManager(num_blocks=32, block_size=BS)
    prefill(manager, 0, public=0)
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT, public_prefix_len=8)) == 0
    prefill(manager, 0)
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT, public_prefix_len=8)) == 12
    manager.check_invariants()


def test_extra_keys_separate_and_forks_inherit_them() -> None:
    manager, a, b = tenancy()
    seq = prefill(manager, a, extra=b"lora-1")
    assert manager.num_tokens(manager.register(tenant=a, prompt_token_ids=PROMPT), a) == 0
    assert manager.num_tokens(manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=8,
                                               cache_extra_key=b"lora-2"), b) == 0
    assert manager.num_tokens(manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=8,
                                               cache_extra_key=b"lora-1"), b) == 8
    assert manager.num_tokens(manager.register(tenant=a, prompt_token_ids=PROMPT, public_prefix_len=8,
                                               cache_extra_key=b"lora-1"), a) == 12
    child = manager.fork(seq, 1, tenant=a)[0]
    manager.append(child, 2, tenant=a, token_ids=[7, 7])  # fills the child's fourth block
    manager.append(child, 1, tenant=a, token_ids=[7])  # seals it, hashed with the inherited key
    tokens = PROMPT + [9, 7, 7, 7]
    expected = chain_hashes(tokens, BS, b"a", extra=b"lora-1", num_public=2)
    assert manager.allocator.cache.entries[int(manager.block_table(child, a)[3])].block_hash == expected[3]
    assert manager.num_tokens(manager.register(tenant=a, prompt_token_ids=tokens + [0], public_prefix_len=8,
                                               cache_extra_key=b"lora-1"), a) == 16
    manager.check_invariants()


def test_an_extra_key_without_a_prompt_applies_from_the_first_append() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS)
    seq = manager.register(cache_extra_key=b"img:1f2e")
    manager.append(seq, 5, token_ids=PROMPT[:5])
    manager.append(seq, 1, token_ids=[0])
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT[:5])) == 0
    assert manager.num_tokens(manager.register(prompt_token_ids=PROMPT[:5], cache_extra_key=b"img:1f2e")) == 4


def test_a_tenant_at_its_quota_gets_its_public_match_cut_short() -> None:
    manager, a, b = tenancy()
    prefill(manager, a)
    manager.tenants.set_limits(b, TenantLimits(max_blocks=1))
    seq = manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=8)
    assert manager.num_tokens(seq, b) == 4  # two public blocks held by a, but b may hold only one
    assert manager.tenants.num_blocks[b] == 1
    manager.check_invariants()
    manager.tenants.set_limits(b, TenantLimits(max_blocks=2))
    second = manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=8)
    assert manager.num_tokens(second, b) == 8  # the first block b holds already costs nothing more
    assert manager.tenants.num_blocks[b] == 2
    manager.check_invariants()


def test_bad_register_arguments_change_nothing() -> None:
    manager, a, b = tenancy()
    prefill(manager, a)
    for kwargs in ({"prompt_token_ids": PROMPT, "public_prefix_len": len(PROMPT) + 1},
                   {"public_prefix_len": 4},
                   {"prompt_token_ids": PROMPT, "public_prefix_len": -1},
                   {"prompt_token_ids": PROMPT, "cache_extra_key": bytes(MAX_EXTRA_KEY_BYTES + 1)}):
        before = snapshot(manager)
        with pytest.raises(InvalidArgumentError):
            manager.register(tenant=b, **kwargs)
        assert snapshot(manager) == before and manager.tenants.num_sequences[b] == 0
    manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=len(PROMPT),
                     cache_extra_key=bytes(MAX_EXTRA_KEY_BYTES))  # the limits themselves are fine
    manager.check_invariants()


# ---------------------------------------------------------------- corrupting tests
@pytest.fixture
def shared() -> tuple[KVCacheManager, int, int]:
    manager, a, b = tenancy()
    prefill(manager, a)
    manager.register(tenant=b, prompt_token_ids=PROMPT, public_prefix_len=8)
    manager.check_invariants()
    return manager, a, b


def test_a_private_block_held_by_two_tenants_is_caught(shared) -> None:
    manager, a, b = shared
    block_id = int(np.flatnonzero(manager.allocator.cache.is_public)[0])
    manager.allocator.cache.is_public[block_id] = False  # as if a's private block were in b's row
    with pytest.raises(InvariantViolationError, match="two tenants"):
        check_tenants(manager)  # (the cache's own check, which check_invariants runs first, sees it too)


def test_public_refs_that_miscount_the_rows_are_caught(shared) -> None:
    manager, a, b = shared
    key = next(iter(manager.tenants.public_refs))
    manager.tenants.public_refs[key] += 1
    with pytest.raises(InvariantViolationError, match="public_refs"):
        manager.check_invariants()


def test_a_public_mark_on_a_private_block_is_caught(shared) -> None:
    manager, a, b = shared
    private = next(blk for blk, e in manager.allocator.cache.entries.items() if e.salt != PUBLIC_SALT)
    manager.allocator.cache.is_public[private] = True
    with pytest.raises(InvariantViolationError, match="is_public"):
        manager.check_invariants()
