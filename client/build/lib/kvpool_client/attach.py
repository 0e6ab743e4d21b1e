"""attach(): the server's pool mapped into this process, without a copy.

    server process                              this process
    +-------------------------------+           +--------------------------------------+
    | pool (cudaMalloc or /dev/shm) | <-------> | AttachedPool.blocks                  |
    +-------------------------------+   same    |   [num_blocks, L, 2, block_size, H, D]|
          DescribePool: layout +        memory  | layer_kv(l) -> K, V views            |
          shm_name / CUDA IPC handle            | write_slots(slots, kv) / read_slots  |
                                                +--------------------------------------+

The host backend maps POSIX shared memory (NumPy views); the GPU backend opens the CUDA IPC handle through CuPy
(CuPy views). CuPy is imported only on the GPU path, so the client imports without it.

Write only into slots that AppendToken just returned for your own sequences: the server has already run any
copy-on-write copy, so those blocks are yours alone. Views taken from ``blocks`` die with ``close()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import layout as kvlayout
from kvpool_client.errors import InvalidArgumentError

if TYPE_CHECKING:
    from kvpool_client.client import KVPoolClient
    from kvpool_client.types import PoolDescription


class AttachedPool:
    """The pool of one server, mapped into this process. A context manager; ``close()`` unmaps it."""

    def __init__(self, description: PoolDescription, mapped: Any) -> None:
        self.description = description
        self.layout = description.layout
        self.num_blocks = description.num_blocks
        self.backend = description.backend
        self._mapped = mapped
        flat = mapped.flat
        if flat.dtype != self.layout.storage_dtype:
            flat = flat.view(self.layout.storage_dtype)
        self._blocks = kvlayout.blocks_view(flat, self.layout, self.num_blocks)
        self._xp = np if isinstance(self._blocks, np.ndarray) else _cupy()
        if self._xp is not np:
            self._xp.cuda.Device(description.cuda_device).use()  # the pool's device for every later kernel

    @property
    def closed(self) -> bool:
        return self._mapped is None

    @property
    def blocks(self) -> Any:
        """The whole pool as [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] (NumPy or CuPy)."""
        if self._mapped is None:
            raise ValueError("the pool is closed")
        return self._blocks

    def layer_kv(self, layer: int) -> tuple[Any, Any]:
        """Zero-copy K and V of one layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} is outside 0..{self.layout.num_layers - 1}")
        return kvlayout.layer_kv(self.blocks, layer)

    def _check_slots(self, slots: Any) -> np.ndarray:
        if hasattr(slots, "__cuda_array_interface__"):
            slots = slots.get()  # slots are few; bounds are checked on the host
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        limit = self.num_blocks * self.layout.block_size
        if slots.size and (slots.min() < 0 or slots.max() >= limit):
            raise InvalidArgumentError(f"slots must lie in [0, {limit}), got [{slots.min()}, {slots.max()}]")
        return slots

    def write_slots(self, slots: Any, data: Any) -> None:
        """Write token KV ``data`` [n, num_layers, 2, num_kv_heads, head_dim] into ``slots`` (int64 [n]).

        On the GPU the write is synchronized before returning, so the server and other processes see it."""
        slots = self._check_slots(slots)
        shape = (slots.size, *self.layout.token_shape)
        if tuple(data.shape) != shape:
            raise InvalidArgumentError(f"data must be {shape}, got {tuple(data.shape)}")
        if data.dtype != self.layout.storage_dtype:
            raise InvalidArgumentError(f"data must be {self.layout.storage_dtype}, got {data.dtype}")
        if self._xp is np:
            kvlayout.scatter_tokens(self.blocks, slots, self.layout.block_size, data)
        else:
            cp = self._xp
            block_ids, offsets = self._device_index(slots)
            self.blocks[block_ids, :, :, offsets] = cp.asarray(data)
            cp.cuda.get_current_stream().synchronize()

    def read_slots(self, slots: Any) -> np.ndarray:
        """A host copy of the KV at ``slots``, as [n, num_layers, 2, num_kv_heads, head_dim]."""
        slots = self._check_slots(slots)
        if self._xp is np:
            return kvlayout.gather_tokens(self.blocks, slots, self.layout.block_size)
        block_ids, offsets = self._device_index(slots)
        return self._xp.asnumpy(self.blocks[block_ids, :, :, offsets])

    def _device_index(self, slots: np.ndarray) -> tuple[Any, Any]:
        """(block_ids, offsets) of host slots, as device arrays (CuPy refuses implicit host conversion)."""
        block_ids, offsets = kvlayout.split_slots(slots, self.layout.block_size)
        return self._xp.asarray(block_ids), self._xp.asarray(offsets)

    def close(self) -> None:
        """Drop this object's views and unmap the pool (idempotent)."""
        if self._mapped is None:
            return
        mapped, self._mapped, self._blocks = self._mapped, None, None
        mapped.close()

    def __enter__(self) -> AttachedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cupy() -> Any:
    import cupy  # noqa: PLC0415  (lazy: the client installs without CuPy)

    return cupy


def attach(client: KVPoolClient) -> AttachedPool:
    """DescribePool, then map the pool: shared memory on the host backend, CUDA IPC through CuPy on a GPU."""
    from kvpool_client import mapping  # noqa: PLC0415  (mapping imports CuPy lazily on the GPU path)

    description = client.describe_pool()
    if description.backend == "host":
        mapped = mapping.map_host_pool(description.shm_name, description.pool_bytes)
    elif description.backend == "gpu":
        mapped = mapping.map_gpu_pool(description.cuda_ipc_handle, description.pool_bytes, description.cuda_device)
    else:
        raise InvalidArgumentError(f"the server reports backend {description.backend!r}; cannot attach")
    return AttachedPool(description, mapped)
