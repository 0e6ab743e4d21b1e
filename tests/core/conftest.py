import numpy as np
import pytest

from kvpool_server.core import KVCacheManager


def snapshot(manager: KVCacheManager) -> tuple:
    """Everything observable about a manager, for 'an error changes nothing' checks."""
    seqs = sorted(manager.index.seq_ids())
    return (
        manager.allocator.ref_count.tobytes(),
        manager.allocator.free_block_ids().tobytes(),
        tuple(
            (s, manager.num_tokens(s), manager.block_table(s).tobytes(), int(manager.tables.next_slot[manager.index.row(s)]))
            for s in seqs
        ),
        manager.stats(),
        manager.num_copies,
    )


@pytest.fixture
def manager() -> KVCacheManager:
    return KVCacheManager(num_blocks=16, block_size=4, max_seq_len=40)


@pytest.fixture
def assert_unchanged():
    """Use as: with assert_unchanged(manager): <call that must raise and change nothing>."""

    class _Unchanged:
        def __init__(self, manager):
            self.manager = manager

        def __enter__(self):
            self.before = snapshot(self.manager)

        def __exit__(self, *exc):
            assert snapshot(self.manager) == self.before, "a failed operation changed the manager"
            self.manager.check_invariants()
            return False

    return _Unchanged


def tag_memory(manager: KVCacheManager) -> np.ndarray:
    """A stand-in for KV memory in core tests: one int64 tag per token slot."""
    return np.full(manager.num_blocks * manager.block_size, -1, dtype=np.int64)


def run_copies(memory: np.ndarray, copies: np.ndarray, block_size: int) -> None:
    for src, dst in copies.tolist():
        memory[dst * block_size : (dst + 1) * block_size] = memory[src * block_size : (src + 1) * block_size]
