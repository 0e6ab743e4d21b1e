"""The fast path's arguments as its records' arrays (``fast_commands``): a decode step's ids and counts converted
as cheaply as the common case allows, token ids as uint32, and None for anything unusual -- the call then goes
over gRPC, which gives its own precise error. Nothing here raises."""

from __future__ import annotations

import array as pyarray
from typing import Any

import numpy as np


class LastIds:
    """The last list of ids converted, and its uint64 array (read-only): a decode loop appends to the same batch
    step after step, and comparing the ids (a tuple compare) costs a fifth of converting them again. One (ids,
    array) pair, replaced whole: safe across threads."""

    pair: tuple[tuple[Any, ...], np.ndarray] = ((), np.zeros(0, dtype=np.uint64))


ONES = np.ones(4096, dtype=np.int64)  # a decode step's counts, one each, copied from here (np.full is 3x slower)
ONES.flags.writeable = False
ONE_TOKEN = np.ones(1, dtype=np.uint32)  # the decode step's counts field (read-only: only written into records)
ONE_TOKEN.flags.writeable = False


def id_array(seq_ids: list[Any] | tuple[Any, ...]) -> tuple[tuple[Any, ...], np.ndarray]:
    ids = tuple(seq_ids)
    last_ids, last_array = LastIds.pair
    if ids == last_ids:  # equal values convert equally
        return last_ids, last_array
    array = np.asarray(ids, dtype=np.uint64)
    array.flags.writeable = False
    if array.ndim == 1:
        LastIds.pair = (ids, array)
    return ids, array


def append_args(seq_ids: Any, num_tokens: Any) -> tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(ids, ids as uint64, one count per id, the counts the record carries, their total), cheaper than
    convert.append_args for a decode step; None for anything unusual (gRPC's path then raises its own error)."""
    try:
        if isinstance(seq_ids, (int, np.integer)):
            seq_ids = [int(seq_ids)]
        if isinstance(seq_ids, (list, tuple)):
            ids, ids_u64 = id_array(seq_ids)
        else:
            ids_u64 = np.asarray(seq_ids, dtype=np.uint64)
            ids = ()
        if ids_u64.ndim != 1 or ids_u64.size == 0:
            return None
        if not ids:
            ids = tuple(ids_u64.tolist())
        if isinstance(num_tokens, (int, np.integer)):
            if num_tokens < 1 or num_tokens >= 1 << 32:
                return None
            n = ids_u64.size
            one_each: np.ndarray = ONES[:n].copy() if num_tokens == 1 and n <= ONES.size else \
                np.full(n, int(num_tokens), dtype=np.int64)  # a copy: each result owns its counts
            field = ONE_TOKEN if num_tokens == 1 else np.array([num_tokens], dtype=np.uint32)
            return ids, ids_u64, one_each, field, int(num_tokens) * n
        counts: np.ndarray = np.asarray(num_tokens, dtype=np.int64)
        if counts.shape != ids_u64.shape or (counts < 1).any() or (counts >= 1 << 32).any():
            return None
        return ids, ids_u64, counts, counts.astype(np.uint32), int(counts.sum())
    except (TypeError, ValueError, OverflowError):
        return None


def uint32_tokens(values: Any) -> np.ndarray | None:
    """``values`` as uint32 token ids, or None when they are not (gRPC then gives its own error). A list of Python
    ints goes through ``array.array`` (~6x faster than NumPy's per-element conversion: a 4,352-token prompt
    0.25 -> 0.04 ms), its range checked as NumPy's."""
    try:
        if isinstance(values, list):
            array = np.frombuffer(memoryview(pyarray.array("q", values)), dtype=np.int64)
        else:
            array = np.asarray(values)
        if array.ndim != 1:
            return None
        dtype = array.dtype
        if dtype.kind == "u" and dtype.itemsize <= 4:  # in range by its type: no pass over the values
            return array.astype(np.uint32, copy=False)
        if array.size and (dtype.kind not in "iu" or array.min() < 0 or array.max() >= 1 << 32):
            return None
        return array.astype(np.uint32, copy=False)
    except (TypeError, ValueError, OverflowError):
        return None


def uint64_ok(ids: list[Any]) -> bool:
    """Every id fits a uint64 (else gRPC gives its own error)."""
    try:
        np.asarray(ids, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError):
        return False
    return True
