"""The host tier's copy totals (``TierPool.copy_totals``: Stats.host_tier's and the metrics' bytes and seconds), on
each backend: a completed offload, restore and write-back each count their bytes once, with the time they took; a
copy that raised and a failed write-back count nothing."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_server.device import create_pool
from kvpool_server.offload.create import create_tier_pool
from kvpool_server.offload.tier_pool import CopyTotals, InjectedCopyError

from tests.device.devtest_util import BACKENDS, fill_random

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")
NUM_BLOCKS, NUM_SLOTS = 32, 40


@pytest.mark.parametrize("backend", BACKENDS)
def test_completed_copies_count_their_bytes_and_seconds_once(backend: str) -> None:
    with create_pool(LAYOUT, backend=backend, num_blocks=NUM_BLOCKS) as pool:
        fill_random(pool, np.random.default_rng(6))
        tier = create_tier_pool(pool, NUM_SLOTS)
        assert tier.wait_ready(30) and tier.copy_totals() == CopyTotals()
        bb = LAYOUT.block_bytes
        tier.offload_blocks(np.stack([np.arange(6), np.arange(6)], axis=1).astype(np.int32))
        tier.restore_blocks(np.stack([np.arange(4), np.arange(10, 14)], axis=1).astype(np.int32))
        ticket = tier.start_offload(np.stack([np.arange(20, 25), np.arange(6, 11)], axis=1).astype(np.int32))
        first = tier.copy_totals()
        assert (first.bytes_offloaded, first.bytes_restored) == (6 * bb, 4 * bb)  # the write-back: not yet settled
        assert tier.settle_writeback(ticket)
        totals = tier.copy_totals()
        assert (totals.bytes_offloaded, totals.bytes_restored) == (11 * bb, 4 * bb)
        assert totals.offload_seconds > first.offload_seconds > 0 and totals.restore_seconds > 0
        tier.inject_failures(1)  # the next offload and restore each move half their pairs, then raise
        with pytest.raises(InjectedCopyError):
            tier.offload_blocks(np.stack([np.arange(6), np.arange(6)], axis=1).astype(np.int32))
        with pytest.raises(InjectedCopyError):
            tier.restore_blocks(np.stack([np.arange(4), np.arange(10, 14)], axis=1).astype(np.int32))
        tier.inject_failures(1, restores=False)
        failed = tier.start_offload(np.stack([np.arange(20, 25), np.arange(6, 11)], axis=1).astype(np.int32))
        assert not tier.settle_writeback(failed)
        assert tier.copy_totals() == totals
