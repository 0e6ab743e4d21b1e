"""The host tier of a tensor-parallel pool (device/sharded_tier_pool.py): one tier per shard behind one slot-id space;
blocks offloaded and restored into other blocks come back whole (every head of every rank); a failure on any shard
fails the group's copy; the group is ready when every shard is."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool.tensor_parallel import group_block_bytes
from kvpool_server.device import create_pool
from kvpool_server.offload.create import create_tier_pool
from kvpool_server.offload.sharded_tier_pool import ShardedTierPool

from tests.device.devtest_util import BACKENDS, random_tokens, to_host

NUM_BLOCKS, NUM_SLOTS = 16, 24


def slots_of(layout: KVLayout, blocks: np.ndarray) -> np.ndarray:
    return (blocks[:, None] * layout.block_size + np.arange(layout.block_size)).reshape(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads, tp", [(4, 2), (2, 4)], ids=["split", "replicated"])
def test_offloaded_blocks_restore_whole_on_every_shard(backend: str, heads: int, tp: int) -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=heads, head_dim=8, block_size=4, dtype="float16")
    rng = np.random.default_rng(5)
    ready: list[int] = []
    with create_pool(layout, backend=backend, num_blocks=NUM_BLOCKS, tensor_parallel=tp) as pool:
        tier = create_tier_pool(pool, NUM_SLOTS, chunk_bytes=5 * layout.block_bytes, on_ready=ready.append)
        assert isinstance(tier, ShardedTierPool) and len(tier.tiers) == tp
        assert tier.wait_ready(30) and ready[-1] == NUM_SLOTS and ready == sorted(ready)
        assert tier.slot_bytes == group_block_bytes(layout, tp)
        src = np.array([1, 2, 3, 9, 12], dtype=np.int64)
        tokens = random_tokens(layout, len(src) * layout.block_size, rng)
        pool.write_slots(slots_of(layout, src), tokens)
        slots = np.array([0, 1, 7, 20, 5], dtype=np.int64)  # runs across chunks
        assert tier.offload_blocks(np.stack([src, slots], axis=1)) == len(src)
        pool.zero_blocks(src)
        dst = np.array([4, 0, 15, 6, 8], dtype=np.int64)
        assert tier.restore_blocks(np.stack([slots, dst], axis=1)) == len(src)
        got = to_host(pool.read_slots(slots_of(layout, dst)))
        assert got.tobytes() == to_host(tokens).tobytes()
        totals = tier.copy_totals()
        assert totals.bytes_offloaded == totals.bytes_restored == len(src) * tier.slot_bytes

        tier.inject_failures(1)  # the last shard's next offload and restore fail; the group's copy fails
        with pytest.raises(OSError):
            tier.offload_blocks(np.stack([src, slots], axis=1))
        with pytest.raises(OSError):
            tier.restore_blocks(np.stack([slots, dst], axis=1))
        ticket = tier.start_offload(np.stack([src, slots], axis=1))
        assert tier.settle_writeback(ticket) and ticket.done()
        assert tier.copy_totals().bytes_offloaded == 2 * len(src) * tier.slot_bytes  # failed copies not counted
    assert tier.closed and all(t.closed for t in tier.tiers)
