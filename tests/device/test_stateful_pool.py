"""The core's model-based test, with every token's KV stored in a real pool (host shared memory, or the GPU with
KVPOOL_TEST_BACKEND=gpu) and copy-on-write run by the pool's batched copy -- one pool, and a tensor-parallel group's
pool of 2 and 4 shards (2 heads: split, then replicated)."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import settings

from kvpool.layout import KVLayout
from kvpool_server.device import create_pool
from tests.core.test_stateful import BLOCK_SIZE, NUM_BLOCKS, ManagerMachine

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BLOCK_SIZE, dtype="float32")
ELEMENT_OFFSETS = (np.arange(LAYOUT.token_elems, dtype=np.float32) / 64).reshape(LAYOUT.token_shape)


class PoolManagerMachine(ManagerMachine):
    """Tags become whole token KV: element e of the token tagged t holds t + e/64 (exact in float32)."""

    TENSOR_PARALLEL = 1

    def __init__(self) -> None:
        super().__init__()
        self.pool = create_pool(LAYOUT, backend=os.environ.get("KVPOOL_TEST_BACKEND", "host"), num_blocks=NUM_BLOCKS,
                                tensor_parallel=self.TENSOR_PARALLEL)

    def teardown(self) -> None:
        self.pool.close()

    def copy_blocks(self, copies: np.ndarray) -> None:
        self.pool.copy_blocks(copies)

    def write_tags(self, slots: np.ndarray, tags: list[int]) -> None:
        data = np.asarray(tags, dtype=np.float32).reshape(-1, 1, 1, 1, 1) + ELEMENT_OFFSETS
        self.pool.write_slots(slots, data)

    def read_tags(self, slots: np.ndarray) -> list[int]:
        data = np.asarray(self.pool.read_slots(slots))
        tags = data[:, 0, 0, 0, 0]
        expected = tags.reshape(-1, 1, 1, 1, 1) + ELEMENT_OFFSETS
        assert np.array_equal(data, expected), "a token's KV is torn: its elements disagree"
        return tags.astype(np.int64).tolist()


PoolManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestManagerOnRealPool = PoolManagerMachine.TestCase

for _n in (2, 4):  # the same machine over a ShardedPool of _n shards
    _machine = type(f"PoolManagerMachineTP{_n}", (PoolManagerMachine,), {"TENSOR_PARALLEL": _n})
    _machine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
    globals()[f"TestManagerOnShardedPool{_n}"] = _machine.TestCase
