"""KVPool: the one allocation that holds every KV block, and ``create_pool`` that picks its backend and size.

The core (``kvpool_server.core``) plans in block ids; the pool acts on bytes::

    plan = manager.append(seq_ids, num_tokens)
    pool.copy_blocks(plan.copies)                  # copy-on-write, before anyone writes the new slots
    pool.zero_blocks(plan.zero_block_ids)          # blocks changing hands: the old owner's bytes never show
    pool.write_slots(plan.slot_mapping, token_kv)  # [n, L, 2, H, D] in the layout's storage dtype

Two backends share this interface: ``GpuPool`` (one raw ``cudaMalloc``, exported by CUDA IPC) and ``HostPool``
(POSIX shared memory, mapped by name). This module imports neither CuPy nor a backend until one is asked for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool.layout import KVLayout, layer_kv

BACKENDS = ("auto", "gpu", "host")


@dataclass(frozen=True)
class PoolAttachInfo:
    """What another process needs to map the pool: a shm name (host) or a CUDA IPC handle + device (gpu).

    The handle names the base of the pool's dedicated allocation; block ``b`` starts at ``b * block_bytes``.
    """

    backend: str
    pool_bytes: int
    shm_name: str | None = None
    cuda_ipc_handle: bytes | None = None
    cuda_device: int | None = None


@dataclass(frozen=True)
class RankShard:
    """One rank's part of the pool: the heads of the full layout it holds (``heads``), its pool's layout (those
    heads only) and what maps it. A pool of one rank is one shard holding every head."""

    rank: int
    heads: range
    layout: KVLayout
    attach: PoolAttachInfo


class KVPool:
    """KV memory, block-major ``[num_blocks, L, 2, block_size, H, D]`` or layer-major ``[L, 2, num_blocks,
    block_size, H, D]`` (``layout.kv_layout``; see ``kvpool.layout``). ``blocks`` is the logical 6-d view
    ``[num_blocks, L, 2, block_size, H, D]`` in both (a transposed view for layer-major).

    Invariants:
    - One allocation of exactly ``pool_bytes == num_blocks * layout.block_bytes``, made in ``__init__`` and never
      resized; after start-up no operation allocates device memory (scratch buffers are made up front).
    - ``blocks`` and ``layer_kv`` are views of that allocation, never copies.
    - A copy batch is valid only if every id is in ``[0, num_blocks)``, destinations are distinct and no
      destination is a source of the same batch (the core's copy-on-write destinations are fresh blocks), so the
      copies of a batch are independent and may run in any order or in parallel. ``copy_blocks`` checks this.
    - ``zero_blocks(ids)`` sets every byte of each named block (all layers, K and V) to zero; ids must be in
      ``[0, num_blocks)`` (repeats are harmless). An empty batch returns at once: no launch, no allocation.
    - Slots of one ``write_slots`` call are distinct (the core never hands out a slot twice); if not, which write
      wins is unspecified.
    - Every operation has finished, on the device too, when it returns: other processes that mapped the pool see
      its effect without further synchronisation.
    - Operations are serialised by a lock (they share scratch buffers); ``close()`` is idempotent and after it
      operations raise ``RuntimeError``.
    """

    backend: str = ""
    tensor_parallel: int = 1  # ranks whose KV heads the pool holds apart (ShardedPool); 1: one pool, every head

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the pool needs at least one block, got num_blocks={num_blocks}")
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.pool_bytes = self.num_blocks * layout.block_bytes
        self.num_slots = self.num_blocks * layout.block_size
        self.blocks: Any = None  # the 6-d view; set by the backend
        self.tier: Any = None  # the host tier beside the pool (offload.create_tier_pool), closed with it
        self._closed = False
        self._lock = threading.Lock()
        # host scratch for checking a copy batch in O(c): _dst_pos[b] = position of b among the batch's dsts
        self._dst_pos = np.full(self.num_blocks, -1, dtype=np.int64)
        self._positions = np.arange(self.num_blocks, dtype=np.int64)

    # --- public operations: validate here, act in the backend's _copy/_write/_read -------------------------------

    def copy_blocks(self, copies: Any) -> int:
        """Copy whole blocks, ``copies`` int[c, 2] of (src, dst) pairs, as one batch. Returns c."""
        pairs = self._checked_copies(copies)
        with self._lock:
            self._check_open()
            if len(pairs):
                self._copy(pairs)
        return len(pairs)

    def zero_blocks(self, block_ids: Any) -> None:
        """Set every byte of each block in ``block_ids`` int[n] to zero (all layers, K and V), as one batch; done
        on the device too when it returns. A block handed to a new owner is cleared this way, so that neither
        ``read_slots`` nor a client's mapping ever shows the previous owner's KV."""
        ids = np.asarray(block_ids)
        if ids.size == 0:  # the common decode step hands out no block: nothing to check, launch or allocate
            self._check_open()
            return
        ids = self._checked_block_ids(ids)
        with self._lock:
            self._check_open()
            self._zero(ids)

    def block_slots(self, block_ids: Any) -> np.ndarray:
        """Every slot of the blocks ``block_ids`` int[n], block after block: int64 [n * block_size]. With
        ``read_slots`` it reads whole blocks, e.g. to check that a freshly handed-out block reads as zeros."""
        ids = self._checked_block_ids(np.asarray(block_ids)) if np.size(block_ids) else np.zeros(0, np.int32)
        bs = self.layout.block_size
        return (ids.astype(np.int64)[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)

    def write_slots(self, slots: Any, data: Any) -> None:
        """Write token KV ``data`` [n, L, 2, H, D] (storage dtype) into ``slots`` int[n]."""
        slots = self._checked_slots(slots)
        data = np.ascontiguousarray(data)
        expected = (len(slots), *self.layout.token_shape)
        if data.shape != expected:
            raise ValueError(f"data must have shape {expected} (n, L, 2, H, D), got {data.shape}")
        if data.dtype != self.layout.storage_dtype:
            raise ValueError(f"data must be {self.layout.storage_dtype} (the layout's storage dtype), got {data.dtype}")
        with self._lock:
            self._check_open()
            if len(slots):
                self._write(slots, data)

    def read_slots(self, slots: Any) -> np.ndarray:
        """Token KV at ``slots`` as a new host array [n, L, 2, H, D] of the storage dtype."""
        slots = self._checked_slots(slots)
        out = np.empty((len(slots), *self.layout.token_shape), dtype=self.layout.storage_dtype)
        with self._lock:
            self._check_open()
            if len(slots):
                self._read(slots, out)
        return out

    def layer_kv(self, layer: int) -> tuple[Any, Any]:
        """Zero-copy K and V of ``layer``, each [num_blocks, block_size, H, D]: block stride ``block_bytes``
        (block-major) or contiguous (layer-major)."""
        self._check_open()
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        return layer_kv(self.blocks, layer)

    def attach_info(self) -> PoolAttachInfo:
        raise NotImplementedError

    def rank_shards(self) -> list[RankShard]:
        """Each rank's shard and what maps it (one pool: rank 0, every head)."""
        return [RankShard(0, range(self.layout.num_kv_heads), self.layout, self.attach_info())]

    def close(self) -> None:
        """Release the memory (unlink the shm name / free the GPU allocation). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.blocks = None
            if self.tier is not None:
                self.tier.close()
            self._release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.pool_bytes} bytes"
        return f"<{type(self).__name__} {self.backend} {self.num_blocks} blocks of {self.layout.block_bytes} B, {state}>"

    # --- backend hooks ------------------------------------------------------------------------------------------

    def _copy(self, pairs: np.ndarray) -> None:
        raise NotImplementedError

    # The asynchronous halves of _copy / _zero, for a ShardedPool that starts the work on every shard before it
    # waits for any (the GPU overrides them: enqueue on its stream, then synchronise); here they run at once.
    def _start_copy(self, pairs: np.ndarray) -> None:
        self._copy(pairs)

    def _start_zero(self, ids: np.ndarray) -> None:
        self._zero(ids)

    def _wait(self) -> None:
        """Wait until the work ``_start_copy`` / ``_start_zero`` started has finished."""

    def _zero(self, ids: np.ndarray) -> None:
        raise NotImplementedError

    def _write(self, slots: np.ndarray, data: np.ndarray) -> None:
        raise NotImplementedError

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError

    # --- validation ---------------------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the pool is closed")

    def _checked_copies(self, copies: Any) -> np.ndarray:
        arr = np.asarray(copies)
        if arr.size == 0:
            return np.zeros((0, 2), dtype=np.int32)
        if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"copies must be an int array of shape [c, 2] (src, dst), got {arr.dtype} {arr.shape}")
        if arr.min() < 0 or arr.max() >= self.num_blocks:
            raise ValueError(f"copies name blocks outside [0, {self.num_blocks})")
        pairs = np.ascontiguousarray(arr, dtype=np.int32)
        src, dst = pairs[:, 0], pairs[:, 1]
        positions = self._positions[: len(pairs)]
        with self._lock:  # _dst_pos is shared scratch; stale entries from earlier batches are harmless (see below)
            self._dst_pos[dst] = positions
            if not np.array_equal(self._dst_pos[dst], positions):  # a repeated dst keeps only its last position
                raise ValueError("copies must have distinct destination blocks")
            pos = self._dst_pos[src]  # s is a dst of this batch iff pos names a position whose dst is s
            in_batch = (pos >= 0) & (pos < len(pairs))
            if np.any(dst[np.where(in_batch, pos, 0)][in_batch] == src[in_batch]):
                raise ValueError("a destination block of a copy batch must not be a source of the same batch")
        return pairs

    def _checked_block_ids(self, ids: np.ndarray) -> np.ndarray:
        """A non-empty 1-d int array of block ids, each in ``[0, num_blocks)``, as contiguous int32."""
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"block ids must be a 1-d int array, got {ids.dtype} {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.num_blocks:
            raise ValueError(f"block ids name blocks outside [0, {self.num_blocks})")
        return np.ascontiguousarray(ids, dtype=np.int32)

    def _checked_slots(self, slots: Any) -> np.ndarray:
        arr = np.asarray(slots)
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"slots must be a 1-d int array, got {arr.dtype} {arr.shape}")
        if arr.min() < 0 or arr.max() >= self.num_slots:
            raise ValueError(f"slots must be in [0, {self.num_slots}) (num_blocks * block_size)")
        return np.ascontiguousarray(arr, dtype=np.int64)


def gpu_available() -> bool:
    """True if CuPy imports, sees a CUDA device and can allocate on it."""
    try:
        import cupy

        if not cupy.cuda.is_available():
            return False
        cupy.cuda.Memory(256)  # freed at once; proves the runtime and driver work, not just that a device exists
        return True
    except Exception:  # no CuPy, no driver, no device, or a broken CUDA install: all mean "use the host"
        return False


def resolve_num_blocks(
    layout: KVLayout,
    free_bytes: int | None,
    pool_bytes: int | None = None,
    num_blocks: int | None = None,
    gpu_memory_fraction: float | None = None,
) -> int:
    """Blocks for exactly one of: ``num_blocks``, ``pool_bytes`` (rounded down to whole blocks), or
    ``gpu_memory_fraction`` of ``free_bytes`` (the backend's free memory)."""
    given = [name for name, v in (("pool_bytes", pool_bytes), ("num_blocks", num_blocks),
                                  ("gpu_memory_fraction", gpu_memory_fraction)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of pool_bytes, num_blocks, gpu_memory_fraction (got {given or 'none'})")
    if num_blocks is not None:
        blocks = int(num_blocks)
    elif pool_bytes is not None:
        blocks = layout.num_blocks_for(int(pool_bytes))
    else:
        assert gpu_memory_fraction is not None and free_bytes is not None
        if not 0.0 < gpu_memory_fraction <= 1.0:
            raise ValueError(f"gpu_memory_fraction must be in (0, 1], got {gpu_memory_fraction}")
        blocks = layout.num_blocks_for(int(free_bytes * gpu_memory_fraction))
    if blocks < 1:
        raise ValueError(f"the pool must hold at least one block of {layout.block_bytes} bytes")
    return blocks
