"""A chain's pending blocks kept compact (core/chain.py ``PendingRun``): read as CachedBlocks, a decode step's
filled block a row of ``TokenChains.pending_tokens`` (``FilledBlock``) that survives the rows growing and a fork,
and sealed with the token ids it was hashed from."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.core import KVCacheManager, filled_blocks, token_chains
from kvpool_server.core.block_hash import chain_hashes
from kvpool_server.core.chain import Chain, FilledBlock, PendingRun, SharedPending
from kvpool_server.core.filled_blocks import FilledBatch, SealColumns

BS = 4


def cached_tokens(manager: KVCacheManager) -> dict[bytes, list[int]]:
    return {e.block_hash: e.token_ids.tolist() for e in manager.allocator.cache.entries.values()}


def test_a_prompts_blocks_are_one_run_read_as_cached_blocks() -> None:
    manager = KVCacheManager(num_blocks=32, block_size=BS)
    seq = manager.register(prompt_token_ids=list(range(10)))
    manager.append(seq, 10, token_ids=list(range(10)))
    run = manager.chains.chains[manager.index.row(seq)].pending
    assert isinstance(run, PendingRun) and not isinstance(run, FilledBlock) and len(run) == 2
    blocks = list(run)
    assert [b.block_hash for b in blocks] == chain_hashes(list(range(8)), BS)
    assert [b.token_ids.tolist() for b in blocks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert blocks[1].parent_hash == blocks[0].block_hash and blocks[0].parent_hash == bytes(32)
    manager.check_invariants()


def test_a_filled_block_keeps_its_tokens_as_rows_grow_and_through_a_fork() -> None:
    manager = KVCacheManager(num_blocks=256, block_size=BS, max_num_seqs=512)
    seqs = [manager.register(prompt_token_ids=[]) for _ in range(3)]
    manager.append(seqs, 1, token_ids=[1, 2, 3])
    for step in range(1, BS):
        manager.append(seqs, 1, token_ids=[10 * step + k for k in range(3)])  # fills every row's block 0
    rows = [manager.index.row(s) for s in seqs]
    runs = [manager.chains.chains[row].pending for row in rows]
    assert all(isinstance(r, FilledBlock) and r.at == row for r, row in zip(runs, rows))
    expected = [[1, 10, 20, 30], [2, 11, 21, 31], [3, 12, 22, 32]]
    more = [manager.register(prompt_token_ids=[5]) for _ in range(100)]  # rows past the first 64: the arrays grow
    assert manager.chains.pending_tokens.shape[0] > 64
    assert [list(r)[0].token_ids.tolist() for r in runs] == expected
    manager.check_invariants()
    child = manager.fork(seqs[0], 1)[0]
    shared = manager.chains.chains[rows[0]].pending
    assert isinstance(shared, SharedPending) and shared is manager.chains.chains[manager.index.row(child)].pending
    for step in range(BS):  # the parent seals block 0 and fills block 1: its pending_tokens row is written again
        manager.append(seqs[0], 1, token_ids=[100 + step])
    assert manager.chains.pending_tokens[rows[0]].tolist() == [100, 101, 102, 103]
    assert list(shared)[0].token_ids.tolist() == expected[0]  # the child's: its own copy
    manager.check_invariants()
    manager.append(child, 1, token_ids=[7])  # seals nothing more (the parent did); then everyone else's
    manager.append(seqs, 1, token_ids=[6, 8, 9])  # the parent's block 1 too
    tokens = cached_tokens(manager)
    assert sorted(tokens.values()) == sorted(expected + [[100, 101, 102, 103]])
    manager.free([*seqs, child, *more])
    manager.check_invariants()


def test_a_seal_of_filled_blocks_from_different_steps_and_rows_inserts_each_ones_tokens() -> None:
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    a, b = manager.register(prompt_token_ids=[]), manager.register(prompt_token_ids=[])
    manager.append(a, 3, token_ids=[1, 2, 3])
    manager.append([a, b], 1, token_ids=[4, 50])  # fills a's block 0
    manager.append(b, 3, token_ids=[51, 52, 53])  # fills b's block 0 (its own step)
    assert isinstance(manager.chains.chains[manager.index.row(a)].pending, FilledBlock)
    manager.append([b, a], 1, token_ids=[9, 9])  # one seal of both, each from its own step
    assert sorted(cached_tokens(manager).values()) == [[1, 2, 3, 4], [50, 51, 52, 53]]
    assert manager.allocator.cache.entries.tokens.dtype == np.uint32
    manager.check_invariants()


def test_a_seal_reads_the_filling_steps_batch_only_when_its_rows_and_runs_are_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``TokenChains.filled`` (filled_blocks.py ``FilledBatch``): the next step sealing the same rows in the same
    order takes the columns the filling step made; another order, a row sealed or refilled in between, or a fork
    misses it -- and every way inserts each block with its own hash, parent and token ids."""
    from_batch: list[bool] = []

    def seal_columns(batch: FilledBatch | None, rows: np.ndarray, chains: list[Chain]) -> SealColumns | None:
        columns = filled_blocks.seal_columns(batch, rows, chains)
        from_batch.append(columns is not None and batch is not None and columns[0] is batch.hashes)
        return columns

    monkeypatch.setattr(token_chains, "seal_columns", seal_columns)

    def run(order: str) -> dict[bytes, list[int]]:
        manager = KVCacheManager(num_blocks=64, block_size=BS)
        seqs = [manager.register(prompt_token_ids=[]) for _ in range(3)]
        for step in range(BS):
            manager.append(seqs, 1, token_ids=[10 * step + k for k in range(3)])  # fills every row's block 0
        chains = manager.chains
        assert chains.filled is not None and chains.filled.rows.tolist() == [manager.index.row(s) for s in seqs]
        if order == "reversed":
            seqs = seqs[::-1]
        elif order == "one sealed first":
            manager.append(seqs[1], 1, token_ids=[99])
        elif order == "one refilled":
            manager.append(seqs[1], BS, token_ids=[99, 98, 97, 96])  # seals block 0, hashes block 1 (its own run)
        elif order == "forked":
            manager.fork(seqs[0], 1)
        from_batch.clear()
        manager.append(seqs, 1, token_ids=[7, 8, 9])
        assert from_batch == [order == "same"], order
        manager.check_invariants()
        return cached_tokens(manager)

    expected = run("same")
    assert sorted(expected.values()) == [[0, 10, 20, 30], [1, 11, 21, 31], [2, 12, 22, 32]]
    assert run("reversed") == run("one sealed first") == run("forked") == expected
    refilled = run("one refilled")
    assert refilled.items() >= expected.items() and len(refilled) == 4


def test_decode_steps_over_a_public_prefix_and_past_it_hash_each_block_with_its_salt() -> None:
    """The same rows filling block after block one token a step (``hash_filled`` reusing the batch before's salts
    and headers only once no block of it is public): the public prefix's blocks with PUBLIC_SALT, the rest with the
    tenant's, every one in the cache as ``chain_hashes`` of the tokens says."""
    manager = KVCacheManager(num_blocks=64, block_size=BS)
    prompts = [[100 * k + i for i in range(2 * BS)] for k in range(3)]
    seqs = [manager.register(prompt_token_ids=p, public_prefix_len=2 * BS) for p in prompts]
    tokens = [[*p, *range(50 * k, 50 * k + 2 * BS + 1)] for k, p in enumerate(prompts)]
    for step in range(4 * BS + 1):  # the prompt's two public blocks, then two more, then one to seal them
        manager.append(seqs, 1, token_ids=[t[step] for t in tokens])
        manager.check_invariants()
    cached = manager.allocator.cache.block_of_hash
    for t in tokens:
        hashes = chain_hashes(t, BS, num_public=2)
        assert len(hashes) == 4 and all(h in cached for h in hashes)


def test_the_decode_steps_batch_copies_into_a_check_snapshot() -> None:
    """CheckInvariants copies the manager's state into a snapshot made at start-up, field by field
    (service/invariant_checks.py): a ``FilledBatch`` kept by the last decode step goes with it, and the copy checks."""
    import copy

    from kvpool_server.service.invariant_checks import copy_state

    manager = KVCacheManager(num_blocks=64, block_size=BS)
    snapshot = copy.deepcopy(manager)
    seqs = [manager.register(prompt_token_ids=[]) for _ in range(3)]
    for step in range(2 * BS + 1):  # two batches: the second fills the same chains, the seal between them
        manager.append(seqs, 1, token_ids=[10 * step + k for k in range(3)])
        copy_state(manager, snapshot)
        snapshot.check_invariants()
    assert isinstance(snapshot.chains.filled, FilledBatch) and snapshot.chains.filled is not manager.chains.filled
    assert snapshot.chains.filled.hashes == manager.chains.filled.hashes
