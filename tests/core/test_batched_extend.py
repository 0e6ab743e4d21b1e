"""A multi-row append with token ids (``TokenChains._extend`` of all rows, a prefill's seal gathered in one index:
``_seal_own``) leaves the core exactly as the same appends made one sequence at a time.

Twin managers go through the same rounds: a burst of registers (prompts of random lengths, some none), appends in
random chunks (the rest of each prompt first, whose hashes its register kept; token ids for most, none for some
rows: those stay untracked), decode steps, frees. On one twin each append is one call for every sequence, on the
other one call a sequence, in order. After every call the two hold the same state (tables, ref counts, cache,
records, evictable order, chains, partial tokens, kept prompt hashes), keep their invariants and hold the tokens
appended. The pool never evicts here: a batch and its single appends evict in different orders, so their block ids
would differ (evictions: test_prefix_cache.py, test_stateful.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool_server.core import KVCacheManager

BS = 4


def state(manager: KVCacheManager) -> tuple:
    chains, cache, tables = manager.chains, manager.allocator.cache, manager.tables
    rows = sorted(chains.chains)
    return (
        tables.table.tobytes(), tables.num_tokens.tobytes(), manager.allocator.ref_count.tobytes(),
        manager.allocator.free_block_ids().tobytes(), dict(cache.block_of_hash), list(cache.evictable),
        {b: (e.block_hash, e.parent_hash, e.token_ids.tobytes(), e.salt, e.extra) for b, e in cache.entries.items()},
        list(cache.entries), cache.num_evicted,
        {row: (c.salt, c.num_sealed, c.sealed_hash, [(e.block_hash, e.parent_hash, e.token_ids.tobytes(), e.salt)
                                                     for e in c.pending]) for row, c in chains.chains.items()},
        [chains.partial_tokens(row).tobytes() for row in rows], chains.has_pending.tobytes(),
        chains.tracked.tobytes(), dict(chains.prompts.entries), chains.prompts.num_bytes,
    )


def same(batched: KVCacheManager, single: KVCacheManager, tokens_of: dict[int, list[int]]) -> None:
    """The twins agree, keep their invariants, and hold the tokens appended (``tokens_of``: each live sequence's):
    a tracked sequence's partial tokens and pending blocks, and every cached block of a sequence."""
    assert state(batched) == state(single)
    batched.check_invariants()
    single.check_invariants()
    chains, cache = batched.chains, batched.allocator.cache
    for seq_id, tokens in tokens_of.items():
        row = batched.index.row(seq_id)
        assert batched.num_tokens(seq_id) == len(tokens)
        blocks = [tokens[i : i + BS] for i in range(0, len(tokens), BS)]
        for k, block_id in enumerate(batched.block_table(seq_id).tolist()):
            if block_id in cache.entries:
                assert cache.entries[block_id].token_ids.tolist() == blocks[k]
        chain = chains.chains.get(row)
        if chain is not None:
            assert chains.partial_tokens(row).tolist() == tokens[len(tokens) // BS * BS :]
            for k, entry in enumerate(chain.pending):
                assert entry.token_ids.tolist() == blocks[chain.num_sealed + k]


def append_both(batched: KVCacheManager, single: KVCacheManager, ids: list[int], counts: list[int],
                tokens: list[np.ndarray] | None) -> None:
    """The append on both twins: one call on ``batched``, one a sequence on ``single``; the same slots."""
    batched_plan = batched.append(ids, counts, token_ids=None if tokens is None else np.concatenate(tokens))
    slots = [single.append(s, c, token_ids=None if tokens is None else t).slot_mapping
             for s, c, t in zip(ids, counts, tokens or [None] * len(ids))]
    assert np.array_equal(batched_plan.slot_mapping, np.concatenate(slots))


@pytest.mark.parametrize("seed", range(80))
def test_a_multi_row_append_is_the_appends_one_by_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    batched, single = (KVCacheManager(num_blocks=96, block_size=BS, max_seq_len=48, max_num_seqs=16) for _ in range(2))
    vocab = int(rng.integers(2, 50))  # a small vocabulary: prompts share blocks, hashes repeat
    next_id = 1
    for _ in range(4):
        num = int(rng.integers(1, 9))
        prompts = [rng.integers(0, vocab, size=int(rng.integers(0, 25)), dtype=np.uint32) for _ in range(num)]
        args = [p if p.size and rng.random() < 0.8 else None for p in prompts]
        ids = list(range(next_id, next_id + num))  # caller-chosen: the twins' server ids would differ
        next_id += num
        assert batched.register_many(num, seq_ids=ids, prompt_token_ids=args) == ids
        assert single.register_many(num, seq_ids=ids, prompt_token_ids=args) == ids
        tokens_of = {s: p[: batched.num_tokens(s)].tolist() for s, p in zip(ids, prompts)}  # the cached run
        # what each appends: the rest of its prompt (whose hashes its register kept), then tokens of its own
        script = {s: [*p[batched.num_tokens(s) :].tolist(), *rng.integers(0, vocab, size=40).tolist()]
                  for s, p in zip(ids, prompts)}
        same(batched, single, tokens_of)
        plain = {s for s in ids if rng.random() < 0.15}  # appended without token ids: untracked from then on

        def append(seq_ids: list[int], counts: list[int], with_ids: bool, script: dict[int, list[int]] = script,
                   tokens_of: dict[int, list[int]] = tokens_of) -> None:
            tokens = [np.array(script[s][:c], dtype=np.uint32) for s, c in zip(seq_ids, counts)] if with_ids else None
            append_both(batched, single, seq_ids, counts, tokens)
            for s, c in zip(seq_ids, counts):
                taken, script[s] = script[s][:c], script[s][c:]
                tokens_of[s] += taken
            same(batched, single, tokens_of)

        for _ in range(int(rng.integers(1, 4))):  # the prefill, in chunks
            # at least 2 tokens each: one token for one sequence is the decode step's path, which leaves a register's
            # kept prompt hashes where a multi-token append takes them (the same hashes either way)
            counts = {s: int(rng.integers(2, 10)) for s in ids}
            if plain and rng.random() < 0.5:  # a separate call without token ids for those
                rest = [s for s in ids if s not in plain]
                append(sorted(plain), [counts[s] for s in sorted(plain)], False)
                if rest:
                    append(rest, [counts[s] for s in rest], True)
            else:
                append(ids, [counts[s] for s in ids], True)
        for _ in range(int(rng.integers(0, 6))):  # decode steps: a block filled, sealed by the next
            append(ids, [1] * len(ids), True)
        batched.free(ids)
        single.free(ids)
        same(batched, single, {})
