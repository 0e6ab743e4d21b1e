"""A register's hashes of its prompt's blocks, kept for the prefill (``PromptHashes``): the prefill reuses them
instead of hashing the blocks again, and whatever the appends carry -- the prompt, other tokens, the prompt in
chunks, a decode token first, a fork or a free in between -- the blocks' hashes (the cache's, the KV events') are
exactly those of a manager that keeps nothing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool_server.core import InvariantViolationError, KVCacheManager
from kvpool_server.core import token_chains
from kvpool_server.core.prompt_hashes import PromptBlocks

BS = 4


def cached_content(manager: KVCacheManager) -> dict[bytes, tuple]:
    """hash -> (parent, tokens, salt, extra) of every cached block."""
    return {e.block_hash: (e.parent_hash, e.token_ids.tolist(), e.salt, e.extra)
            for e in manager.allocator.cache.entries.values()}


def make(keep: bool, tenancy: bool = False) -> KVCacheManager:
    manager = KVCacheManager(num_blocks=256, block_size=BS, max_seq_len=128, tenancy=tenancy)
    if not keep:
        manager.chains.prompts.max_bytes = 0  # keeps nothing: every block hashed from its tokens
    return manager


def test_the_prefill_reuses_the_registers_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = token_chains.chain_encoded  # a prefill's blocks not kept are hashed there: one call, a block each counted
    monkeypatch.setattr(token_chains, "chain_encoded",
                        lambda data, bs, *a: calls.extend([1] * (len(data) // (4 * bs))) or real(data, bs, *a))
    manager, reference = make(True), make(False)
    prompt = list(range(1, 19))  # 4 full blocks and 2 tokens
    for m in (manager, reference):
        seq = m.register(prompt_token_ids=prompt)
        assert m.chains.prompts.num_bytes == (4 * BS * 4 + 4 * 32 if m is manager else 0)
        calls.clear()
        m.append(seq, len(prompt), token_ids=prompt)
        assert len(calls) == (0 if m is manager else 4)
        assert m.chains.prompts.num_bytes == 0 and not m.chains.prompts.entries
        m.append(seq, token_ids=[7])  # seals the prompt's blocks
        m.check_invariants()
    assert cached_content(manager) == cached_content(reference) and len(cached_content(manager)) == 4


def test_a_prefill_in_chunks_reuses_every_hash(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 6 tokens (block size 4: they end mid-block) take the kept hashes a few blocks at a time."""
    calls = []
    real = token_chains.chain_encoded  # a prefill's blocks not kept are hashed there: one call, a block each counted
    monkeypatch.setattr(token_chains, "chain_encoded",
                        lambda data, bs, *a: calls.extend([1] * (len(data) // (4 * bs))) or real(data, bs, *a))
    manager, reference = make(True), make(False)
    prompt = list(range(1, 27))  # 6 full blocks and 2 tokens
    for m in (manager, reference):
        seq = m.register(prompt_token_ids=prompt)
        hashed = 0
        for at in range(0, len(prompt), 6):
            calls.clear()
            m.append(seq, len(prompt[at : at + 6]), token_ids=prompt[at : at + 6])
            hashed += len(calls)  # the appends' hashing only (check_invariants may hash too)
            m.check_invariants()
        assert hashed == (0 if m is manager else 6)
        assert not m.chains.prompts.entries and m.chains.prompts.num_bytes == 0
        m.append(seq, token_ids=[7])
    assert cached_content(manager) == cached_content(reference) and len(cached_content(manager)) == 6


def test_a_prompt_of_whole_blocks_keeps_its_last_block_too() -> None:
    """A register never matches the prompt's last block (one token is left to compute) but hashes it for the
    prefill: with 8 tokens of block size 4, both blocks are kept."""
    manager = make(True)
    manager.register(prompt_token_ids=list(range(8)))
    (entry,) = manager.chains.prompts.entries.values()
    assert entry.first == 0 and len(entry.hashes) == 2


def test_a_cached_run_is_not_kept_again() -> None:
    manager = make(True)
    prompt = list(range(10))
    a = manager.register(prompt_token_ids=prompt)
    manager.append(a, 10, token_ids=prompt)
    manager.append(a, token_ids=[1])  # seals blocks 0 and 1
    b = manager.register(prompt_token_ids=prompt + list(range(50, 56)))  # 16 tokens: blocks 0, 1 cached
    assert manager.num_tokens(b) == 8
    entry = manager.chains.prompts.entries[manager.index.row(b)]
    assert entry.first == 2 and len(entry.hashes) == 2 and entry.parent == manager.chains.chains[manager.index.row(b)].sealed_hash
    manager.check_invariants()


def test_kept_hashes_are_bounded_in_bytes() -> None:
    manager = make(True)
    manager.chains.prompts.max_bytes = 2 * (BS * 4 + 32)  # room for two blocks
    manager.register(prompt_token_ids=list(range(9)))  # two blocks: kept
    manager.register(prompt_token_ids=list(range(100, 105)))  # one more: over the bound, not kept
    assert len(manager.chains.prompts.entries) == 1 and manager.chains.prompts.num_bytes == 2 * (BS * 4 + 32)
    manager.check_invariants()


def test_a_free_before_the_prefill_forgets_the_rows_hashes() -> None:
    manager = make(True)
    seq = manager.register(prompt_token_ids=list(range(9)))
    manager.free(seq)
    assert not manager.chains.prompts.entries and manager.chains.prompts.num_bytes == 0
    manager.check_invariants()


def test_an_untracked_append_forgets_the_rows_hashes() -> None:
    manager = make(True)
    seq = manager.register(prompt_token_ids=list(range(9)))
    manager.append(seq, 9)  # no token ids: the row is no longer tracked
    assert not manager.chains.prompts.entries
    manager.check_invariants()


@pytest.mark.parametrize("corrupt", ["hash", "bytes", "row"])
def test_check_invariants_catches_bad_kept_hashes(corrupt: str) -> None:
    manager = make(True)
    seq = manager.register(prompt_token_ids=list(range(9)))
    prompts, row = manager.chains.prompts, manager.index.row(seq)
    entry = prompts.entries[row]
    if corrupt == "hash":
        prompts.entries[row] = entry._replace(hashes=[entry.hashes[1], entry.hashes[0]])
    elif corrupt == "bytes":
        prompts.num_bytes += 1
    else:
        prompts.entries[row + 1] = PromptBlocks(0, entry.parent, [], b"")
    with pytest.raises(InvariantViolationError):
        manager.check_invariants()


@settings(max_examples=150, deadline=None)
@given(length=st.integers(1, 40), cached=st.integers(0, 40), chunks=st.lists(st.integers(1, 20), min_size=1,
       max_size=4), change_at=st.none() | st.integers(0, 60), decode_first=st.integers(0, 6), same=st.booleans(),
       fork=st.booleans(), public=st.integers(0, 12), extra=st.sampled_from([b"", b"lora"]), tenancy=st.booleans())
def test_hashes_equal_those_of_a_manager_that_keeps_nothing(length: int, cached: int, chunks: list[int],
                                                            change_at: int | None, decode_first: int, same: bool,
                                                            fork: bool, public: int, extra: bytes,
                                                            tenancy: bool) -> None:
    """``same``: every token the same (blocks at other positions have the same tokens: only the chain's position
    tells a kept hash from a wrong one)."""
    prompt = [5] * length if same else list(range(1000, 1000 + length))
    appended = list(prompt) + ([5] * 200 if same else list(range(5000, 5200)))  # the prompt, then more
    if change_at is not None:
        appended[change_at] = 7  # a token other than the prompt's
    events = {}
    for keep in (True, False):
        m = make(keep, tenancy)
        tenant = m.tenants.tenant_id("t") if tenancy else None
        warm_prompt = prompt[:cached]
        if warm_prompt:  # an earlier sequence caches the prompt's first blocks
            warm = m.register(prompt_token_ids=warm_prompt, tenant=tenant,
                              public_prefix_len=min(public, len(warm_prompt)), cache_extra_key=extra)
            done = m.num_tokens(warm, tenant)
            m.append(warm, len(warm_prompt) - done, tenant=tenant, token_ids=warm_prompt[done:])
            m.append(warm, tenant=tenant, token_ids=[3])
        seq = m.register(prompt_token_ids=prompt, tenant=tenant, public_prefix_len=min(public, length),
                         cache_extra_key=extra)
        at = m.num_tokens(seq, tenant)
        m.check_invariants()
        for _ in range(decode_first):  # decode steps before the prefill (a block filled: the chain has moved on)
            m.append(seq, tenant=tenant, token_ids=[appended[at]])
            at += 1
        children = m.fork(seq, 1, tenant=tenant) if fork else []
        for n in chunks:
            for s in [seq] + children:
                m.append(s, n, tenant=tenant, token_ids=appended[at : at + n])
                m.check_invariants()
            at += n
        for s in [seq] + children:
            m.append(s, tenant=tenant, token_ids=[9])  # seals
        m.check_invariants()
        events[keep] = cached_content(m)
        m.free([seq] + children, tenant=tenant)
        m.check_invariants()
        assert not m.chains.prompts.entries and m.chains.prompts.num_bytes == 0
    assert events[True] == events[False]


@pytest.mark.parametrize("length", [1, 7, 8, 9, 16])  # a partial block, block-aligned (the last block hashed anew)
@pytest.mark.parametrize("public", [0, 4, 8])
def test_a_register_given_its_prompt_hashes_starts_as_one_that_hashes_them(length: int, public: int) -> None:
    """``register(..., prompt_hashes=...)`` (the service hashes the prompt before taking the lock): the same cached
    run, the same kept hashes and, after the prefill and a decode step, the same cached blocks as a register that
    hashes the prompt itself -- a cached prefix included, public blocks too; a list of the wrong length is not
    used."""
    first = list(range(100, 100 + length))
    prompt = first[: min(length, 12)] + list(range(1, length - min(length, 12) + 1))
    results = []
    for kind in ("none", "hashes", "wrong"):
        m = make(True)
        old = m.register(prompt_token_ids=first, public_prefix_len=min(public, length))
        m.append(old, length, token_ids=first)
        m.append(old, token_ids=[7])  # seals them: ``prompt`` finds its first blocks cached
        hashes = m.prefix.prompt_hashes(None, prompt, min(public, length))
        known = {"none": None, "hashes": hashes, "wrong": hashes + [b"x" * 32]}[kind]
        seq = m.register(prompt_token_ids=prompt, public_prefix_len=min(public, length), prompt_hashes=known)
        kept = m.chains.prompts.num_bytes
        cached = m.num_tokens(seq)
        m.append(seq, length - cached, token_ids=prompt[cached:])
        m.append(seq, token_ids=[9])
        m.check_invariants()
        results.append((cached, kept, cached_content(m)))
    assert results[0] == results[1] == results[2]
