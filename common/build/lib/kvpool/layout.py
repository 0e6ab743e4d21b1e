"""KVLayout: the shape of the pool's memory, shared by the server (which owns it) and clients (which map it).

The pool is one allocation, block-major::

    pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]      (2 = K, V)

    block b:  | layer 0 K: block_size x heads x dim | layer 0 V | layer 1 K | layer 1 V | ... |
              <------------------------------- block_bytes ------------------------------->

A block is one contiguous span of ``block_bytes``, so a copy-on-write copy is a single span copy and a block id
plus the pool's base address is all another process needs. Each layer's K (or V) is a zero-copy strided view
``[num_blocks, block_size, num_kv_heads, head_dim]`` -- the cache shape vLLM's and FlashInfer's paged-attention
kernels read -- whose block stride is ``block_bytes``. A token's slot is ``block_id * block_size + offset``.

The seed's shape (16 tokens a block, 128 float32 per token) is ``KVLayout(num_layers=1, num_kv_heads=1,
head_dim=64, block_size=16, dtype="float32")``: 512 bytes a token, 8 KiB a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# bfloat16 has no NumPy dtype; it is stored (and read back) as its raw 16-bit pattern.
_STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_STORAGE_DTYPES)}, got {self.dtype!r}")

    @property
    def storage_dtype(self) -> np.dtype:
        return np.dtype(_STORAGE_DTYPES[self.dtype])

    @property
    def itemsize(self) -> int:
        return self.storage_dtype.itemsize

    @property
    def token_shape(self) -> tuple[int, int, int, int]:
        """One token's KV over all layers: [num_layers, 2, num_kv_heads, head_dim]."""
        return (self.num_layers, 2, self.num_kv_heads, self.head_dim)

    @property
    def token_elems(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim

    @property
    def token_bytes(self) -> int:
        return self.token_elems * self.itemsize

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def num_blocks_for(self, pool_bytes: int) -> int:
        return pool_bytes // self.block_bytes


def blocks_view(flat: Any, layout: KVLayout, num_blocks: int) -> Any:
    """View a flat array of the storage dtype (NumPy or CuPy) as [num_blocks, L, 2, block_size, H, D], no copy."""
    return flat[: num_blocks * layout.block_bytes // layout.itemsize].reshape(layout.block_shape(num_blocks))


def layer_kv(blocks: Any, layer: int) -> tuple[Any, Any]:
    """Zero-copy K and V of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    return blocks[:, layer, 0], blocks[:, layer, 1]


def split_slots(slots: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots -> (block_ids, offsets)."""
    slots = np.asarray(slots, dtype=np.int64)
    return slots // block_size, slots % block_size


def gather_tokens(blocks: Any, slots: np.ndarray, block_size: int) -> Any:
    """KV of tokens at ``slots`` as [n, L, 2, H, D] (a copy), from a blocks view."""
    block_ids, offsets = split_slots(slots, block_size)
    return blocks[block_ids, :, :, offsets]


def scatter_tokens(blocks: Any, slots: np.ndarray, block_size: int, data: Any) -> None:
    """Write [n, L, 2, H, D] token KV into ``slots`` of a blocks view."""
    block_ids, offsets = split_slots(slots, block_size)
    blocks[block_ids, :, :, offsets] = data
