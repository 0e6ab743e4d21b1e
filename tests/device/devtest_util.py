"""Helpers for the device tests: which backends to run, random fills, byte-level comparison.

KVPOOL_TEST_BACKEND=gpu makes the GPU cases mandatory (they fail instead of skipping without a GPU), so a GPU run
cannot pass by skipping everything; =host runs the host cases only; unset: host, plus gpu when one is available.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest

from kvpool.layout import KVLayout, storage_of
from kvpool_server.device import gpu_available

REQUESTED = os.environ.get("KVPOOL_TEST_BACKEND", "")
if REQUESTED not in ("", "host", "gpu"):
    raise RuntimeError(f"KVPOOL_TEST_BACKEND must be 'gpu', 'host' or unset, got {REQUESTED!r}")
HAVE_GPU = gpu_available()
RUN_GPU = REQUESTED == "gpu" or (REQUESTED == "" and HAVE_GPU)

needs_gpu = pytest.mark.skipif(not RUN_GPU, reason="no GPU (set KVPOOL_TEST_BACKEND=gpu to require one)")
BACKENDS = ["host", pytest.param("gpu", marks=needs_gpu)]


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of a NumPy or CuPy array."""
    if type(x).__module__.startswith("cupy"):
        return x.get()
    return np.array(x, copy=True)


def like(ref: Any, x: np.ndarray) -> Any:
    """``x`` as an array of the same library (NumPy or CuPy) as ``ref``."""
    if type(ref).__module__.startswith("cupy"):
        import cupy

        return cupy.asarray(x)
    return x


def pool_bytes_view(pool: Any) -> Any:
    """The pool's memory as a flat uint8 array (NumPy or CuPy), a view, in storage order."""
    return storage_of(pool.blocks, pool.layout).reshape(-1).view(np.uint8)


def fill_random(pool: Any, rng: np.random.Generator) -> np.ndarray:
    """Fill the whole pool with random bytes (never left zero); returns a host copy of them in the order of the
    logical view ``pool.blocks`` (the storage order for block-major)."""
    data = rng.integers(1, 256, size=pool.pool_bytes, dtype=np.uint8)  # no zero byte: a missed write shows
    view = pool_bytes_view(pool)
    if pool.backend == "gpu":
        import cupy

        view.set(data)
        # set() runs on CuPy's current stream (the legacy default), which a non-blocking stream -- the pool's -- does
        # not wait for: without this the pool's next operation can overtake the upload's DMA.
        cupy.cuda.Device().synchronize()
    else:
        view[...] = data
    return as_bytes(to_host(pool.blocks)) if pool.layout.layer_major else data


def random_tokens(layout: Any, n: int, rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns in the storage dtype, [n, L, 2, H, D]; compare them as bytes (they may be NaNs)."""
    raw = rng.integers(1, 256, size=n * layout.token_bytes, dtype=np.uint8)
    return raw.view(layout.storage_dtype).reshape(n, *layout.token_shape)


def as_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8)


# Layouts every pool operation is tested on: small, partial copy chunks, each vector width, odd rows.
LAYOUTS = [
    KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float32"),  # the seed: 8 KiB blocks
    KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="bfloat16"),  # 2 KiB
    KVLayout(num_layers=5, num_kv_heads=2, head_dim=40, block_size=16, dtype="float32"),  # 51200 B: a partial chunk
    KVLayout(num_layers=1, num_kv_heads=1, head_dim=2, block_size=1, dtype="float16"),  # 8 B: 8-byte vectors
    KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="float16"),  # 4 B: 4-byte vectors
    KVLayout(num_layers=3, num_kv_heads=3, head_dim=3, block_size=5, dtype="float16"),  # odd rows (18 B)
]


# every layout again in layer-major order: [L, 2, num_blocks, block_size, H, D] (a block is 2L spans)
LAYOUTS += [dataclasses.replace(layout, kv_layout="layer-major") for layout in LAYOUTS]


def ids(layout: KVLayout) -> str:
    return (f"L{layout.num_layers}H{layout.num_kv_heads}D{layout.head_dim}B{layout.block_size}{layout.dtype}"
            + ("-layer-major" if layout.layer_major else ""))
