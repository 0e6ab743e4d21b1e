"""The seed's three checks, done with real memory: KV bytes live in the pool and are read back through page tables.

Runs on the host backend here (POSIX shared memory) and on the GPU backend when KVPOOL_TEST_BACKEND=gpu.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_server.core import KVCacheManager
from kvpool_server.device import create_pool

SEED_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float32")  # 128 f32/token
BACKEND = os.environ.get("KVPOOL_TEST_BACKEND", "host")


def token_pattern(seq_key: int, positions: np.ndarray, layout: KVLayout = SEED_LAYOUT) -> np.ndarray:
    """KV for tokens of one sequence, unique to (sequence, position) in every element: [n, L, 2, H, D]."""
    elems = np.arange(layout.token_elems, dtype=np.float64)
    values = seq_key * 1_000_003.0 + positions[:, None] * 1_009.0 + elems[None, :] * 0.5
    return np.mod(values, 16_777_216.0).astype(np.float32).reshape(len(positions), *layout.token_shape)


@pytest.fixture
def pool_and_manager():
    pool = create_pool(SEED_LAYOUT, backend=BACKEND, pool_bytes=4 << 20)  # 512 blocks
    manager = KVCacheManager(pool.num_blocks, SEED_LAYOUT.block_size)
    yield pool, manager
    pool.close()


def read_block(pool, block_id: int) -> np.ndarray:
    slots = block_id * SEED_LAYOUT.block_size + np.arange(SEED_LAYOUT.block_size)
    return pool.read_slots(slots)


def test_a_five_blocks_distinct_patterns_read_back_and_free(pool_and_manager):
    pool, manager = pool_and_manager
    free_before = manager.allocator.num_free_blocks
    block_ids = manager.allocator.allocate(5)
    patterns = {}
    for i, block_id in enumerate(block_ids.tolist()):
        data = token_pattern(1000 + i, np.arange(SEED_LAYOUT.block_size))
        pool.write_slots(block_id * 16 + np.arange(16), data)
        patterns[block_id] = data
    errors = sum(int((read_block(pool, b) != data).sum()) for b, data in patterns.items())
    assert errors == 0
    assert len({read_block(pool, b).tobytes() for b in patterns}) == 5  # the patterns really differ
    manager.allocator.decref(block_ids)
    assert manager.allocator.num_free_blocks == free_before
    manager.check_invariants()


def test_b_page_table_over_non_contiguous_blocks(pool_and_manager):
    pool, manager = pool_and_manager
    # Interleave two sequences, then free one: the survivor's blocks are physically scattered.
    keep, gap = manager.register(), manager.register()
    for _ in range(6):
        manager.append([keep, gap], 16)
    manager.free(gap)
    table = manager.block_table(keep)
    assert not np.array_equal(table, np.arange(table[0], table[0] + table.size)), "blocks should have gaps"
    for logical, _ in enumerate(table):
        positions = np.arange(logical * 16, logical * 16 + 16)
        pool.write_slots(manager.slots(keep, logical * 16, 16, for_write=True), token_pattern(keep, positions))
    # Reuse the freed gaps for another sequence with its own data: it must not disturb the first.
    other = manager.register()
    plan = manager.append([other], 6 * 16)
    pool.write_slots(plan.slot_mapping, token_pattern(other, np.arange(96)))
    for seq_id in (keep, other):
        read = pool.read_slots(manager.slots(seq_id, 0, manager.num_tokens(seq_id)))
        assert np.array_equal(read, token_pattern(seq_id, np.arange(96)))
    manager.check_invariants()


def test_c_multi_sequence_run(capsys):
    """8 concurrent, 100 completions, prompts 4-32, targets 32-256, 256 MB pool, 16-token blocks, 128 f32/token."""
    concurrency, completions, rng = 8, 100, np.random.default_rng(2023)
    pool = create_pool(SEED_LAYOUT, backend=BACKEND, pool_bytes=256 << 20)
    try:
        manager = KVCacheManager(pool.num_blocks, SEED_LAYOUT.block_size)
        live: dict[int, int] = {}  # seq_id -> target length
        started = finished = errors = 0
        peak_used = peak_unused = 0
        longest_target = 0

        def start() -> None:
            nonlocal started, longest_target
            prompt, target = int(rng.integers(4, 33)), int(rng.integers(32, 257))
            seq_id = manager.register()
            plan = manager.append(seq_id, prompt)
            pool.write_slots(plan.slot_mapping, token_pattern(seq_id, np.arange(prompt)))
            live[seq_id] = target
            longest_target = max(longest_target, target)
            started += 1

        while started < concurrency:
            start()
        while live:
            seq_ids = list(live)
            lengths = [manager.num_tokens(s) for s in seq_ids]
            plan = manager.append(seq_ids)
            pool.copy_blocks(plan.copies)
            data = np.concatenate([token_pattern(s, np.array([n])) for s, n in zip(seq_ids, lengths)])
            pool.write_slots(plan.slot_mapping, data)
            stats = manager.stats()
            peak_used = max(peak_used, stats.num_blocks_used)
            peak_unused = max(peak_unused, stats.num_slots_unused)
            assert stats.num_slots_unused <= (SEED_LAYOUT.block_size - 1) * len(live)
            for seq_id in [s for s in seq_ids if manager.num_tokens(s) >= live[s]]:
                n = manager.num_tokens(seq_id)
                read = pool.read_slots(manager.slots(seq_id, 0, n))  # through the page table
                errors += int((read != token_pattern(seq_id, np.arange(n))).sum())
                manager.free(seq_id)
                del live[seq_id]
                finished += 1
                if started < completions:
                    start()
            manager.check_invariants()
        final = manager.stats()
    finally:
        pool.close()

    block_bytes = SEED_LAYOUT.block_bytes
    naive_bytes = concurrency * longest_target * SEED_LAYOUT.token_bytes
    paged_bytes = peak_used * block_bytes
    with capsys.disabled():
        print(
            f"\n[seed run] backend={BACKEND} completions={finished} KV errors={errors} "
            f"peak blocks={peak_used}/{pool.num_blocks} (peak utilization {peak_used / pool.num_blocks:.2%}), "
            f"peak unused slots={peak_unused} (internal fragmentation at most {peak_unused}/{peak_used * 16}), "
            f"external fragmentation=0 (any free block serves any sequence), "
            f"paged peak {paged_bytes / 2**20:.2f} MiB vs naive {concurrency}x{longest_target} tokens "
            f"= {naive_bytes / 2**20:.2f} MiB ({paged_bytes / naive_bytes:.1%})"
        )
    assert finished == completions and errors == 0
    assert final.num_blocks_free == final.num_blocks_total and final.num_sequences == 0
    assert paged_bytes < naive_bytes
