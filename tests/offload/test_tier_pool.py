"""The host tier's memory (device/tier_pool.py, gpu_tier_pool.py): blocks offloaded into host slots and restored into
other blocks come back byte for byte, in both block orders, across chunks; the memory is allocated in the
background; an injected failure raises after moving part of the batch; bad pairs change nothing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_server.device import create_pool
from kvpool_server.offload.create import create_tier_pool
from kvpool_server.offload.tier_pool import InjectedCopyError, copy_runs

from tests.device.devtest_util import BACKENDS, fill_random, to_host

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
LAYOUTS = [LAYOUT, dataclasses.replace(LAYOUT, kv_layout="layer-major")]
NUM_BLOCKS, NUM_SLOTS = 32, 40


def block_bytes(pool, block_ids) -> list[bytes]:  # type: ignore[no-untyped-def]
    return [to_host(pool.blocks[b]).tobytes() for b in block_ids]


def test_copy_runs_coalesce_consecutive_blocks_and_slots_within_a_chunk() -> None:
    blocks = np.array([5, 3, 4, 9, 10, 11], dtype=np.int64)
    slots = np.array([2, 0, 1, 7, 8, 12], dtype=np.int64)
    assert copy_runs(blocks, slots, chunk_slots=8) == [(3, 0, 3), (9, 7, 1), (10, 8, 1), (11, 12, 1)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["block-major", "layer-major"])
def test_offloaded_blocks_restore_byte_for_byte(backend: str, layout: KVLayout) -> None:
    rng = np.random.default_rng(3)
    with create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS) as pool:
        fill_random(pool, rng)
        tier = create_tier_pool(pool, NUM_SLOTS, chunk_bytes=7 * layout.block_bytes)  # 6 chunks, the last partial
        assert tier.wait_ready(30) and len(tier.chunks) == 6
        src = np.concatenate([np.arange(4, 12), rng.permutation(np.arange(12, NUM_BLOCKS))[:10]])
        slots = np.concatenate([np.arange(3, 11), rng.permutation(np.arange(11, NUM_SLOTS))[:10]])  # runs cross chunks
        before = block_bytes(pool, src)
        assert tier.offload_blocks(np.stack([src, slots], axis=1).astype(np.int32)) == len(src)
        pool.zero_blocks(src)
        dst = rng.permutation(NUM_BLOCKS)[: len(src)]
        tier.restore_blocks(np.stack([slots, dst], axis=1).astype(np.int32))
        assert block_bytes(pool, dst) == before
        assert tier.bytes_offloaded == tier.bytes_restored == len(src) * layout.block_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_injected_failure_moves_part_then_raises_and_bad_pairs_are_refused(backend: str) -> None:
    with create_pool(LAYOUT, backend=backend, num_blocks=NUM_BLOCKS) as pool:
        fill_random(pool, np.random.default_rng(4))
        tier = create_tier_pool(pool, NUM_SLOTS)
        assert tier.wait_ready(30)
        pairs = np.stack([np.arange(8), np.arange(8)], axis=1).astype(np.int32)
        tier.inject_failures(1, offloads=False)
        tier.offload_blocks(pairs)  # offloads are not hooked
        with pytest.raises(InjectedCopyError):
            tier.restore_blocks(pairs[:, ::-1] + [0, 8])
        tier.restore_blocks(pairs[:, ::-1] + [0, 8])  # one failure only
        for bad in ([[NUM_BLOCKS, 0]], [[0, NUM_SLOTS]], [[0, -1]], [[0, 1, 2]]):
            with pytest.raises(ValueError):
                tier.offload_blocks(np.array(bad))
    with pytest.raises(RuntimeError):
        tier.offload_blocks(pairs)  # closed with the pool


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_write_back_completes_by_its_ticket(backend: str) -> None:
    rng = np.random.default_rng(5)
    with create_pool(LAYOUT, backend=backend, num_blocks=NUM_BLOCKS) as pool:
        fill_random(pool, rng)
        tier = create_tier_pool(pool, NUM_SLOTS)
        assert tier.wait_ready(30)
        src, slots = np.arange(0, 20, 2), np.arange(10)
        before = block_bytes(pool, src)
        ticket = tier.start_offload(np.stack([src, slots], axis=1).astype(np.int32))
        assert ticket.wait() and ticket.done()
        pool.zero_blocks(src)
        tier.restore_blocks(np.stack([slots, src], axis=1).astype(np.int32))
        assert block_bytes(pool, src) == before
        tier.inject_failures(1, restores=False)
        assert not tier.start_offload(np.stack([src, slots], axis=1).astype(np.int32)).wait()
