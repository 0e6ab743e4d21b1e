"""The vectorised decode step of TokenChains (one token per row, most rows not filling a block): after random
mixes of decode steps, multi-token appends, appends without ids, forks and frees -- across tenants, a public prefix
and extra keys -- every tracked row's chain equals the reference encoding (``chain_hashes`` of all its tokens): its
sealed hash, its pending hashes and their tokens, its partial tokens; every sealed block in the cache carries its
reference hash, and the events say the same."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.core import InvariantViolationError, KVCacheManager
from kvpool_server.core.block_hash import chain_hashes
from kvpool_server.core.kv_event_types import CachedBlock

BS = 4


class Model:
    """The reference: each live sequence's tenant, salt, extra key, public blocks and tokens (None: untracked)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.manager = KVCacheManager(num_blocks=4096, block_size=BS, max_seq_len=512, max_num_seqs=64, tenancy=True)
        self.manager.allocator.cache.events = self.events = []  # every sealed entry, in order
        self.tenants = [self.manager.tenants.tenant_id(name) for name in ("acme", "b")]
        self.rng = rng
        self.num_checked = 0  # sealed blocks found in the cache with their reference hash
        self.seqs: dict[tuple[int, int], tuple[bytes, int, list[int] | None]] = {}  # (tenant, id) -> extra, public, tokens

    def tokens(self, num: int) -> list[int]:
        return self.rng.integers(0, 2**32, size=num, dtype=np.uint64).tolist()

    def register(self) -> None:
        tenant = self.tenants[int(self.rng.integers(2))]
        if self.rng.random() < 0.2:  # untracked: appended without ids
            seq = self.manager.register(tenant=tenant)
            self.manager.append(seq, int(self.rng.integers(1, 9)), tenant)
            self.seqs[tenant, seq] = (b"", 0, None)
            return
        extra = b"lora" if self.rng.random() < 0.3 else b""
        prompt = [7, 7, 7, 7, 8, 8, 8, 8] + self.tokens(int(self.rng.integers(1, 12)))  # a shared start: matches
        public = 8 if self.rng.random() < 0.5 else 0
        seq = self.manager.register(tenant=tenant, prompt_token_ids=prompt, public_prefix_len=public,
                                    cache_extra_key=extra)
        done = self.manager.num_tokens(seq, tenant)
        self.manager.append(seq, len(prompt) - done, tenant, token_ids=prompt[done:])
        self.seqs[tenant, seq] = (extra, public // BS, prompt)

    def decode(self, tenant: int) -> None:
        """One token for every sequence of ``tenant`` (one call), with ids; rarely without (they stop tracking)."""
        seqs = [seq for t, seq in self.seqs if t == tenant]
        if not seqs:
            return
        if self.rng.random() < 0.03:
            self.manager.append(seqs, 1, tenant)
            for seq in seqs:
                self.seqs[tenant, seq] = (*self.seqs[tenant, seq][:2], None)
            return
        ids = self.tokens(len(seqs))
        self.manager.append(seqs, 1, tenant, token_ids=ids)
        for seq, token in zip(seqs, ids):
            if self.seqs[tenant, seq][2] is not None:
                self.seqs[tenant, seq][2].append(token)  # type: ignore[union-attr]

    def append_many(self) -> None:
        tenant, seq = list(self.seqs)[int(self.rng.integers(len(self.seqs)))]
        num = int(self.rng.integers(1, 11))
        ids = self.tokens(num)
        self.manager.append(seq, num, tenant, token_ids=ids)
        if self.seqs[tenant, seq][2] is not None:
            self.seqs[tenant, seq][2].extend(ids)  # type: ignore[union-attr]

    def fork(self) -> None:
        tenant, seq = list(self.seqs)[int(self.rng.integers(len(self.seqs)))]
        extra, public, tokens = self.seqs[tenant, seq]
        for child in self.manager.fork(seq, int(self.rng.integers(1, 4)), tenant=tenant):
            self.seqs[tenant, child] = (extra, public, None if tokens is None else list(tokens))

    def free(self) -> None:
        tenant, seq = list(self.seqs)[int(self.rng.integers(len(self.seqs)))]
        self.manager.free([seq], tenant)
        del self.seqs[tenant, seq]

    def check(self) -> None:
        manager = self.manager
        manager.check_invariants()
        chains, cache = manager.chains, manager.allocator.cache
        for (tenant, seq), (extra, num_public, tokens) in self.seqs.items():
            row = manager._row(seq, tenant)
            if tokens is None:
                assert not chains.tracked[row]
                continue
            chain = chains.chains[row]
            salt = manager.tenants.names[tenant].encode()
            expected = chain_hashes(tokens, BS, salt, extra=extra, num_public=num_public)
            assert chain.sealed_hash == (expected[chain.num_sealed - 1] if chain.num_sealed else bytes(32))
            assert [e.block_hash for e in chain.pending] == expected[chain.num_sealed :]
            full = np.array(tokens[: len(expected) * BS], dtype=np.uint32).reshape(-1, BS)
            assert all(np.array_equal(t, full[chain.num_sealed + k]) for k, t in enumerate(e.token_ids for e in chain.pending))
            assert chains.partial_tokens(row).tolist() == tokens[len(expected) * BS :]
            blocks = manager.block_table(seq, tenant)
            for i in range(chain.num_sealed):  # sealed: in the cache, unless its hash was cached in another block
                entry = cache.entries.get(int(blocks[i]))
                assert entry is None or entry.block_hash == expected[i]
                self.num_checked += entry is not None
        for entry in self.events:
            if isinstance(entry, CachedBlock):
                assert chain_hashes(entry.token_ids, BS, entry.salt, entry.parent_hash, entry.extra)[0] == \
                    entry.block_hash


@pytest.mark.parametrize("seed", range(6))
def test_the_decode_step_keeps_every_chain_equal_to_the_reference_encoding(seed: int) -> None:
    model = Model(np.random.default_rng(seed))
    for _ in range(12):
        model.register()
    for step in range(160):
        action = model.rng.random()
        if action < 0.75 or len(model.seqs) < 4:
            model.decode(model.tenants[step % 2])
        elif action < 0.85:
            model.append_many()
        elif action < 0.92 and len(model.seqs) < 48:
            model.fork()
        elif action < 0.96:
            model.free()
        else:
            model.register()
        model.check()
    assert sum(isinstance(e, CachedBlock) for e in model.events) > 50  # blocks were sealed along the way
    assert model.num_checked > 500


def test_a_decode_step_mixing_tracked_untracked_and_new_rows_tracks_the_new_ones_only() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    tracked = manager.register(prompt_token_ids=[1, 2, 3])
    manager.append(tracked, 3, token_ids=[1, 2, 3])
    untracked, new = manager.register(), manager.register()
    manager.append(untracked, 2)
    manager.append([tracked, untracked, new], 1, token_ids=[4, 5, 6])  # fills the tracked row's block
    chains = manager.chains
    assert chains.tracked[[manager.index.row(s) for s in (tracked, untracked, new)]].tolist() == [True, False, True]
    assert chains.partial_tokens(manager.index.row(new)).tolist() == [6]
    assert [e.block_hash for e in chains.chains[manager.index.row(tracked)].pending] == chain_hashes([1, 2, 3, 4], BS)
    manager.append([tracked, new], 1, token_ids=[7, 8])  # seals it
    assert manager.allocator.cache.num_cached == 1
    manager.check_invariants()


@pytest.mark.parametrize("corrupt", ["fill", "untracked fill", "has_pending", "untracked pending", "header",
                                     "num_pending"])
def test_check_invariants_catches_a_corrupted_decode_state(corrupt: str) -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    seq, other = manager.register(prompt_token_ids=[1, 2]), manager.register()
    manager.append(seq, 6, token_ids=[1, 2, 3, 4, 5, 6])  # one block pending, two tokens partial
    manager.append(other, 1)
    manager.check_invariants()
    chains, row, free_row = manager.chains, manager.index.row(seq), manager.index.row(other)
    if corrupt == "fill":
        chains.fill[row] = 3
    elif corrupt == "untracked fill":
        chains.fill[free_row] = 1
    elif corrupt == "has_pending":
        chains.has_pending[row] = False
    elif corrupt == "untracked pending":
        chains.has_pending[free_row] = True
    elif corrupt == "num_pending":
        chains.num_pending += 1
    else:
        chains.chains[row].header = b""
    with pytest.raises(InvariantViolationError):
        manager.check_invariants()


def test_the_partial_array_grows_as_higher_rows_are_tracked() -> None:
    manager = KVCacheManager(num_blocks=1024, block_size=BS, max_num_seqs=1000)
    assert manager.chains.partial.shape == (64, BS)  # not max_num_seqs x block_size up front
    seqs = [manager.register(prompt_token_ids=[i, i]) for i in range(70)]
    manager.append(seqs, 2, token_ids=[i for i in range(70) for _ in range(2)])
    children = manager.fork(seqs[-1], 100)
    manager.append([*seqs, *children], 1, token_ids=list(range(170)))
    manager.check_invariants()
    assert manager.chains.partial.shape == (256, BS)
    assert [manager.chains.partial_tokens(manager.index.row(s)).tolist() for s in (seqs[0], children[-1])] == \
        [[0, 0, 0], [69, 69, 169]]
