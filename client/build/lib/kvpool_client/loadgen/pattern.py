"""The KV a token must hold: a pattern unique to (writer seq_id, position), exact in the pool's dtype.

    key = seq_id * 100003 + position                          (uint64, wrapping)
    element 0, 1, 2 of the token = key in chunks of `bits`   -> distinct keys give distinct tokens (up to 3*bits)
    every other element          = splitmix-style hash of (key, element index), low `bits` bits

Values are small non-negative integers, so they are exact in float32 (bits=24) and float16 (bits=11); for
bfloat16 the pool stores raw 16-bit patterns and we use 14-bit ones (positive, finite). Nothing is ever NaN, so
copies that go through float registers cannot change a bit.

A forked sequence inherits the tokens its parent wrote: its expected KV is the concatenation, over its history of
(writer seq_id, start, stop) segments, of the writer's pattern.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from kvpool.layout import KVLayout

KEY_MULTIPLIER = 100003
_BITS = {"float32": 24, "float16": 11, "bfloat16": 14}


def token_keys(seq_id: int, start: int, stop: int) -> np.ndarray:
    """Keys of positions [start, stop) written by ``seq_id``."""
    with np.errstate(over="ignore"):
        base = np.uint64(seq_id) * np.uint64(KEY_MULTIPLIER)
        return base + np.arange(start, stop, dtype=np.uint64)


def history_keys(history: Iterable[tuple[int, int, int]]) -> np.ndarray:
    """Keys of a whole sequence from its (writer seq_id, start, stop) segments, in position order."""
    parts = [token_keys(writer, start, stop) for writer, start, stop in history]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)


def kv_pattern(keys: np.ndarray, layout: KVLayout) -> np.ndarray:
    """Token KV for ``keys`` as [n, num_layers, 2, num_kv_heads, head_dim] in the layout's storage dtype."""
    keys = np.asarray(keys, dtype=np.uint64)
    bits = _BITS[layout.dtype]
    mask = np.uint64((1 << bits) - 1)
    num_elems = layout.token_elems
    elems = np.arange(1, num_elems + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = keys[:, None] * np.uint64(0x9E3779B97F4A7C15) + elems[None, :] * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(29)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(32)
    values = h & mask
    for i in range(min(3, num_elems)):
        values[:, i] = (keys >> np.uint64(i * bits)) & mask
    return values.astype(layout.storage_dtype).reshape((keys.size, *layout.token_shape))
