"""Results of the core: small immutable records (a NamedTuple, a frozen dataclass) and NumPy arrays, never protobuf
messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class AppendPlan(NamedTuple):
    """What an append did, for the device layer to execute and the caller to write to.

    A NamedTuple (immutable, like the frozen dataclasses below) because one is made per append, and a NamedTuple
    costs half a frozen dataclass to build.

    slot_mapping:  int64 [num_new_tokens], the physical slot (block_id * block_size + offset) of every new token,
                   grouped by sequence in request order.
    new_block_ids: int32 [k], blocks allocated by the append, copy-on-write destinations included.
    copies:        int32 [c, 2], (src_block_id, dst_block_id) copy-on-write pairs; the device layer must run
                   them (``pool.copy_blocks(plan.copies)``) before anyone writes into the new slots.
    """

    slot_mapping: np.ndarray
    new_block_ids: np.ndarray
    copies: np.ndarray

    @property
    def num_new_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's occupancy.

    num_slots_unused counts token slots inside used blocks that hold no token, once per physical block (internal
    fragmentation). External fragmentation is 0 by construction: every free block is usable by any sequence.
    """

    num_blocks_total: int
    num_blocks_free: int
    num_blocks_used: int
    num_blocks_shared: int
    num_tokens: int
    num_slots_unused: int
    num_copies: int
    num_sequences: int
    block_size: int
    num_blocks_evictable: int = 0  # cached blocks nobody holds: allocatable (free + evictable), evicted LRU first
    prefix_query_tokens: int = 0  # prompt tokens registered with their ids since start
    prefix_hit_tokens: int = 0  # of those, tokens found cached (the frontend skips computing them)

    @property
    def utilization(self) -> float:
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def internal_fragmentation(self) -> float:
        used_slots = self.num_blocks_used * self.block_size
        return self.num_slots_unused / used_slots if used_slots else 0.0


EMPTY_BLOCKS = np.zeros(0, dtype=np.int32)
EMPTY_BLOCKS.flags.writeable = False
NO_COPIES = np.zeros((0, 2), dtype=np.int32)
NO_COPIES.flags.writeable = False
