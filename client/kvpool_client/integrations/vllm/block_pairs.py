"""A copy's block ids, (pool id, vLLM id) pairs, checked against both sides' block counts before a copy runs.

The kernel does not check ids (``block_copy.py``): every id reaches it through ``pair_ids`` (ids given as two
sequences) or ``check_pairs`` (the int64 array [2, n] the scheduler built, ``metadata.pairs_of``), and an id
outside its side's range is a ``ValueError`` that names the side, before either copy path runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SIDES = ("pool", "vLLM")


def pair_ids(pool_ids: Sequence[int] | np.ndarray, vllm_ids: Sequence[int] | np.ndarray, pool_blocks: int,
             vllm_blocks: int) -> np.ndarray:
    """The copy's pairs as one int64 array [2, n] (row 0 the pool's ids, row 1 vLLM's), each checked against its
    side's block count (``ValueError`` names the side)."""
    pairs = np.array((pool_ids, vllm_ids), dtype=np.int64) if len(pool_ids) == len(vllm_ids) else None
    if pairs is None or pairs.ndim != 2:
        raise ValueError("a copy pairs a different number of pool and vLLM blocks")
    if pairs.shape[1]:
        low, high = pairs.min(axis=1), pairs.max(axis=1)
        for row, limit in enumerate((pool_blocks, vllm_blocks)):
            if low[row] < 0 or high[row] >= limit:
                raise _outside(row, limit)
    return pairs


def check_pairs(pairs: np.ndarray, pool_blocks: int, vllm_blocks: int) -> None:
    """``pair_ids``'s checks of an int64 array [2, n] made already: one pass over it (a negative id, read as
    unsigned, is above every bound)."""
    if not isinstance(pairs, np.ndarray) or pairs.dtype != np.int64 or pairs.ndim != 2 or pairs.shape[0] != 2:
        raise ValueError("a copy's pairs are not an int64 array [2, n]")
    if pairs.shape[1]:
        high = pairs.view(np.uint64).max(axis=1)
        for row, limit in enumerate((pool_blocks, vllm_blocks)):
            if high[row] >= limit:
                raise _outside(row, limit)


def _outside(row: int, limit: int) -> ValueError:
    return ValueError(f"a copy names a {SIDES[row]} block outside 0..{limit - 1}")
