"""The KV pattern: unique per (writer, position), exact in every pool dtype, and a fork inherits its parent's."""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.layout import KVLayout
from kvpool_client.loadgen.pattern import history_keys, kv_pattern, token_keys

SEED_LAYOUT = KVLayout()  # 128 float32 a token


def test_shape_and_dtype():
    data = kv_pattern(token_keys(3, 0, 5), SEED_LAYOUT)
    assert data.shape == (5, 1, 2, 1, 64)
    assert data.dtype == np.float32


def test_distinct_writers_and_positions_give_distinct_tokens():
    keys = np.concatenate([token_keys(seq_id, 0, 300) for seq_id in (1, 2, 3, 2**40 + 1, 2**63 + 5)])
    rows = kv_pattern(keys, SEED_LAYOUT).reshape(len(keys), -1)
    assert len(np.unique(rows, axis=0)) == len(keys)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_values_are_exact_and_finite_in_every_dtype(dtype):
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype)
    keys = token_keys(12345, 0, 64)
    data = kv_pattern(keys, layout)
    assert data.dtype == layout.storage_dtype
    assert data.shape == (64, *layout.token_shape)
    if dtype != "bfloat16":
        assert np.isfinite(data).all()
        assert (data == np.round(data)).all() and (data >= 0).all()
    else:  # raw bf16 bit patterns: sign bit clear, exponent never all ones (no inf/NaN)
        assert ((data & 0x8000) == 0).all() and (((data >> 7) & 0xFF) != 0xFF).all()
    # Same keys, same bits: a round trip through bytes changes nothing.
    again = np.frombuffer(data.tobytes(), dtype=layout.storage_dtype).reshape(data.shape)
    assert np.array_equal(again.view(np.uint8), kv_pattern(keys, layout).view(np.uint8))
    assert len(np.unique(data.reshape(64, -1), axis=0)) == 64


def test_history_of_a_fork_concatenates_its_writers():
    # Parent 5 wrote 0..10; the child 9 forked at 10 and wrote 10..13.
    keys = history_keys([(5, 0, 10), (9, 10, 13)])
    assert np.array_equal(keys[:10], token_keys(5, 0, 10))
    assert np.array_equal(keys[10:], token_keys(9, 10, 13))
    assert history_keys([]).size == 0
