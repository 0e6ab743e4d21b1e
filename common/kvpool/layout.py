"""KVLayout: the shape of the pool's memory, shared by the server (which owns it) and clients (which map it).

The pool is one allocation in one of two orders (``kv_layout``; the server's ``--kv-layout``). The default is
block-major::

    pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]      (2 = K, V)

    block b:  | layer 0 K: block_size x heads x dim | layer 0 V | layer 1 K | layer 1 V | ... |
              <------------------------------- block_bytes ------------------------------->

A block is one contiguous span of ``block_bytes``, so a copy-on-write copy is a single span copy and a block id
plus the pool's base address is all another process needs. Each layer's K (or V) is a zero-copy strided view
``[num_blocks, block_size, num_kv_heads, head_dim]`` -- the cache shape vLLM's and FlashInfer's paged-attention
kernels read -- whose block stride is ``block_bytes``. A token's slot is ``block_id * block_size + offset``.

Layer-major (``kv_layout="layer-major"``) stores the same bytes per (layer, K/V) first::

    pool[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

    | layer 0 K of block 0 | of block 1 | ... | layer 0 V of block 0 | ... | layer L-1 V of block N-1 |

so each layer's K (and V) is one *contiguous* ``[num_blocks, block_size, H, D]`` tensor -- exactly what vLLM's and
FlashInfer's caches are, and what a kernel that flattens ``[num_blocks * block_size]`` into one token axis
(FlexAttention with a page table) needs. A block is then ``2L`` spans of ``segment_bytes``, one per (layer, K/V),
``seg_stride = num_blocks * segment_bytes`` apart; a copy-on-write copy moves those ``2L`` spans.

Whatever the order, ``blocks_view`` gives the same *logical* 6-d view ``[num_blocks, L, 2, block_size, H, D]``
(a transposed view for layer-major), so ``gather_tokens``, ``scatter_tokens`` and ``layer_kv`` index both alike;
kernels that work on raw addresses use ``strides(num_blocks)`` = (block stride, segment stride) in bytes::

    row (token offset o, segment seg = 2 * layer + kv) of block b  at  b * block_stride + seg * seg_stride
                                                                       + o * row_bytes

The seed's shape (16 tokens a block, 128 float32 per token) is ``KVLayout(num_layers=1, num_kv_heads=1,
head_dim=64, block_size=16, dtype="float32")``: 512 bytes a token, 8 KiB a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# bfloat16 has no NumPy dtype; it is stored (and read back) as its raw 16-bit pattern.
_STORAGE_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
DTYPES = tuple(_STORAGE_DTYPES)  # the element types a layout may have
KV_LAYOUTS = ("block-major", "layer-major")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int = 1
    num_kv_heads: int = 1
    head_dim: int = 64
    block_size: int = 16
    dtype: str = "float32"
    kv_layout: str = "block-major"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in _STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_STORAGE_DTYPES)}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")

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

    @property
    def row_bytes(self) -> int:
        """One token's K (or V) of one layer: num_kv_heads * head_dim elements, contiguous in either order."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def segment_bytes(self) -> int:
        """One block's K (or V) of one layer: block_size rows, contiguous in either order."""
        return self.block_size * self.row_bytes

    @property
    def layer_major(self) -> bool:
        return self.kv_layout == "layer-major"

    def block_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The logical shape of ``blocks_view``, the same in both orders."""
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def storage_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The shape the memory is laid out in (C order)."""
        if self.layer_major:
            return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return self.block_shape(num_blocks)

    def strides(self, num_blocks: int) -> tuple[int, int]:
        """(block stride, segment stride) in bytes: where segment ``seg = 2 * layer + kv`` of block ``b`` starts is
        ``b * block_stride + seg * seg_stride``."""
        if self.layer_major:
            return self.segment_bytes, num_blocks * self.segment_bytes
        return self.block_bytes, self.segment_bytes

    def copy_spans(self, num_blocks: int) -> tuple[int, int]:
        """How a whole-block copy moves: (contiguous spans per block, bytes per span) -- 1 x block_bytes
        (block-major) or 2L x segment_bytes (layer-major)."""
        if self.layer_major:
            return 2 * self.num_layers, self.segment_bytes
        return 1, self.block_bytes

    def num_blocks_for(self, pool_bytes: int) -> int:
        return pool_bytes // self.block_bytes


def blocks_view(flat: Any, layout: KVLayout, num_blocks: int) -> Any:
    """View a flat array of the storage dtype (NumPy or CuPy) as [num_blocks, L, 2, block_size, H, D], no copy
    (C-contiguous for block-major; a transposed view of [L, 2, num_blocks, ...] for layer-major)."""
    raw = flat[: num_blocks * layout.block_bytes // layout.itemsize].reshape(layout.storage_shape(num_blocks))
    return raw.transpose(2, 0, 1, 3, 4, 5) if layout.layer_major else raw


def storage_of(blocks: Any, layout: KVLayout) -> Any:
    """The inverse of ``blocks_view``'s transpose: the logical view back in storage order (C-contiguous), no copy."""
    return blocks.transpose(1, 2, 0, 3, 4, 5) if layout.layer_major else blocks


def segments_view(flat_bytes: Any, layout: KVLayout, num_blocks: int) -> Any:
    """A flat uint8 array (NumPy or CuPy) as [num_blocks, 2L, segment_bytes] bytes, no copy (strided for
    layer-major): row ``[b, seg]`` is block ``b``'s K (seg even) or V (odd) of layer ``seg // 2``."""
    raw = flat_bytes[: num_blocks * layout.block_bytes]
    if layout.layer_major:
        return raw.reshape(2 * layout.num_layers, num_blocks, layout.segment_bytes).transpose(1, 0, 2)
    return raw.reshape(num_blocks, 2 * layout.num_layers, layout.segment_bytes)


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
