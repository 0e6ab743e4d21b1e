"""The calls' plain arguments, checked before anything changes: append's token counts, register's prefix-caching
arguments. Pure functions of values (no state): the manager calls them first."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpool_server.core.block_hash import MAX_EXTRA_KEY_BYTES
from kvpool_server.core.errors import InvalidArgumentError


def append_counts(num_new_tokens: int | Sequence[int] | np.ndarray, num_rows: int) -> int | np.ndarray:
    """An int (>= 1) for every row, or an int64 array of one per row (each >= 1; an int for one row)."""
    if isinstance(num_new_tokens, (int, np.integer)):
        if num_new_tokens < 1:
            raise InvalidArgumentError(f"num_tokens must be >= 1, got {num_new_tokens}")
        return int(num_new_tokens)
    counts = np.asarray(num_new_tokens, dtype=np.int64)
    if counts.shape != (num_rows,):
        raise InvalidArgumentError(f"{counts.size} num_tokens values for {num_rows} sequences")
    if (counts < 1).any():
        raise InvalidArgumentError(f"every num_tokens must be >= 1, got {counts.min()}")
    return counts.item(0) if num_rows == 1 else counts


def append_token_ids(token_ids: Sequence[int] | np.ndarray, num_tokens: int) -> np.ndarray:
    """An append's token ids as uint32, one per appended token."""
    ids = np.asarray(token_ids, dtype=np.uint32)
    if ids.shape != (num_tokens,):
        raise InvalidArgumentError(f"{ids.size} token_ids for {num_tokens} appended tokens")
    return ids


def check_register_args(prompt: np.ndarray | None, public_prefix_len: int, cache_extra_key: bytes,
                        max_seq_len: int) -> None:
    """``register``'s prefix-caching arguments: a prompt no longer than ``max_seq_len`` (checked before any hashing:
    a sequence can never hold more), a public prefix within it, an extra key of bounded size."""
    num_prompt = 0 if prompt is None else prompt.size
    if num_prompt > max_seq_len:
        raise InvalidArgumentError(
            f"prompt_token_ids has {num_prompt} tokens, over max_seq_len={max_seq_len} (the most a sequence may hold)"
        )
    if public_prefix_len < 0:
        raise InvalidArgumentError(f"public_prefix_len must be >= 0, got {public_prefix_len}")
    if public_prefix_len > num_prompt:
        raise InvalidArgumentError(
            f"public_prefix_len={public_prefix_len} is longer than the prompt's {num_prompt} tokens"
        )
    if len(cache_extra_key) > MAX_EXTRA_KEY_BYTES:
        raise InvalidArgumentError(
            f"cache_extra_key has {len(cache_extra_key)} bytes, at most {MAX_EXTRA_KEY_BYTES} are allowed"
        )
