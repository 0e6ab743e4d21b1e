"""LengthLookups: what each length (or position) means for the block tables, as arrays indexed by it."""

from __future__ import annotations

import numpy as np


class LengthLookups:
    """Arrays indexed by a length or position n in [0, max_seq_len], derived once from the tables' shape.

    At a few hundred sequences a NumPy call costs more than its arithmetic (0.3 us for a gather, 0.5 us for a ufunc
    with a scalar, 1 us for a reduction), so the planners gather ``lookup.take(lengths)`` instead of computing
    ``lengths // block_size``, ``lengths % block_size == 0`` or ``lengths.max() >= max_seq_len`` on a whole batch.
    int64 (intp), the dtype NumPy indexes with: narrower lookups cost a cast per call. 34 bytes per token of
    max_seq_len (1.1 MiB for the default 32768). Read-only: nothing writes them after ``__init__``.

    ::

        n             0  1  2  3  4  5  6  7  8      (block_size 4, max_seq_len 8)
        block_index   0  0  0  0  1  1  1  1  2      logical block of position n
        offset        0  1  2  3  0  1  2  3  0      offset of position n inside it
        num_blocks    0  1  1  1  1  2  2  2  2      blocks that hold n tokens (ceil(n / block_size))
        starts_block  T  .  .  .  T  .  .  .  T      token n opens a new block
        at_limit      .  .  .  .  .  .  .  .  T      a sequence of n tokens takes no more
    """

    def __init__(self, max_seq_len: int, block_size: int) -> None:
        n = np.arange(max_seq_len + 1, dtype=np.int64)
        self.block_index: np.ndarray = n // block_size
        self.offset: np.ndarray = n % block_size
        self.num_blocks: np.ndarray = -(-n // block_size)
        self.starts_block: np.ndarray = self.offset == 0
        self.at_limit: np.ndarray = n >= max_seq_len
        # block_size as a 0-d int64 array: int32 block ids times it give int64 slots without a cast.
        self.block_size: np.ndarray = np.array(block_size, dtype=np.int64)
        for array in (self.block_index, self.offset, self.num_blocks, self.starts_block, self.at_limit):
            array.flags.writeable = False
