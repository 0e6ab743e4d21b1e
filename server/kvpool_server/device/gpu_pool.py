"""GpuPool: the pool as one raw ``cudaMalloc``, exported to other processes by CUDA IPC.

Everything the operations need is made here, at start-up, so that no operation allocates device memory:

    pool        cupy.cuda.Memory(pool_bytes)           raw cudaMalloc, not CuPy's caching pool; never resized
                (the scratch buffers below are raw cudaMallocs too, so close() gives everything back)
    pairs       device int32 [2 * num_blocks]          copy pairs (a batch has at most num_blocks destinations)
    pairs_host  pinned int32 [2 * num_blocks]          source of the pairs' async upload
    zero_ids    device int32 [num_blocks]              block ids of a zero_blocks batch (a longer batch can
    ..._host    pinned int32 [num_blocks]              only repeat ids; it goes in pieces of num_blocks)
    staging     device bytes, STAGING_BYTES (at most)  token KV on its way to/from the host; requests larger
    slots       device int64 [staging_tokens]          than staging_tokens tokens go in chunks
    kernels     BlockCopier, BlockZeroer, SlotMover    compiled and loaded now, not at the first call
    stream      one non-blocking stream                every operation runs on it and synchronises before it returns
"""

from __future__ import annotations

import cupy
import numpy as np

from kvpool.layout import KVLayout, blocks_view
from kvpool_server.device.copy_kernel import BlockCopier
from kvpool_server.device.pool import KVPool, PoolAttachInfo
from kvpool_server.device.slot_kernel import SlotMover
from kvpool_server.device.zero_kernel import BlockZeroer

STAGING_BYTES = 64 << 20  # staging holds min(65536 tokens, what fits in 64 MiB), at least one token
STAGING_MAX_TOKENS = 65536
_H2D = 1  # cudaMemcpyHostToDevice
# zero_blocks of one run of consecutive ids: cudaMemsetAsync per span (no id upload, no kernel) when a block has at
# most this many spans -- block-major always (1), layer-major only for 1 layer. Measured on the H200
# (docs/device.md): one memset call ~10 us wall against ~21 us for upload + kernel; 64 spans (Llama layer-major)
# ~250 us. Several runs always take the kernel (one memset a run costs ~4 us of host time each).
MEMSET_SPANS_MAX = 2


def raw_array(n: int, dtype: type) -> cupy.ndarray:
    """A device array on its own ``cudaMalloc`` (not CuPy's caching pool), so that closing returns it."""
    itemsize = np.dtype(dtype).itemsize
    return cupy.ndarray((n,), dtype=dtype, memptr=cupy.cuda.MemoryPointer(cupy.cuda.Memory(n * itemsize), 0))


def zeroes_by_memset(ids: np.ndarray, memsets_per_run: int) -> bool:
    """Whether clearing ``ids`` takes cudaMemsetAsync calls (ids one ascending run, at most MEMSET_SPANS_MAX memsets
    for it: spans of a block, times the pools cleared at once) rather than the zero kernel."""
    if memsets_per_run > MEMSET_SPANS_MAX:
        return False
    return len(ids) == 1 or bool(np.all(np.diff(ids) == 1))


def free_gpu_bytes() -> int:
    free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free)


class GpuPool(KVPool):
    """The pool on the current CUDA device. The allocation is freed when the pool is closed and no array taken
    from ``blocks``/``layer_kv`` is alive any more (CuPy views keep their memory alive; they never dangle).
    Mappings in other processes (``map_gpu_pool``) must be closed before the pool is."""

    backend = "gpu"

    def __init__(self, layout: KVLayout, num_blocks: int, *, staging_bytes: int = STAGING_BYTES) -> None:
        super().__init__(layout, num_blocks)
        self.device = cupy.cuda.Device()
        self.device_id = int(self.device.id)
        self._mem = cupy.cuda.Memory(self.pool_bytes)
        self._base_ptr = int(self._mem.ptr)
        flat = cupy.ndarray((self.pool_bytes // layout.itemsize,), dtype=layout.storage_dtype,
                            memptr=cupy.cuda.MemoryPointer(self._mem, 0))
        self.blocks = blocks_view(flat, layout, self.num_blocks)

        self._stream = cupy.cuda.Stream(non_blocking=True)
        self._pairs = raw_array(2 * self.num_blocks, np.int32)
        self._pairs_pinned = cupy.cuda.alloc_pinned_memory(self._pairs.nbytes)
        self._pairs_host = np.frombuffer(self._pairs_pinned, dtype=np.int32, count=2 * self.num_blocks)
        self._zero_ids = raw_array(self.num_blocks, np.int32)
        self._zero_ids_pinned = cupy.cuda.alloc_pinned_memory(self._zero_ids.nbytes)
        self._zero_ids_host = np.frombuffer(self._zero_ids_pinned, dtype=np.int32, count=self.num_blocks)
        self.staging_tokens = max(1, min(STAGING_MAX_TOKENS, staging_bytes // layout.token_bytes))
        self._staging = raw_array(self.staging_tokens * layout.token_bytes, np.uint8)
        self._slots = raw_array(self.staging_tokens, np.int64)
        self.copier = BlockCopier.for_layout(layout, self.num_blocks)
        self._mover = SlotMover(layout, self.num_blocks)
        self.zeroer = BlockZeroer(layout, self.num_blocks)
        self._ipc_handle: bytes | None = None

    @property
    def base_ptr(self) -> int:
        """The device address of block 0 (the allocation's base; it never moves)."""
        return self._base_ptr

    def attach_info(self) -> PoolAttachInfo:
        self._check_open()
        if self._ipc_handle is None:
            with self.device:  # a shard of a tensor-parallel pool may live on another device than the current one
                self._ipc_handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(self._base_ptr))
        return PoolAttachInfo(backend="gpu", pool_bytes=self.pool_bytes, cuda_ipc_handle=self._ipc_handle,
                              cuda_device=self.device_id)

    def _copy(self, pairs: np.ndarray) -> None:
        self._start_copy(pairs)
        self._wait()  # also makes the pinned pairs buffer reusable by the next call

    def _zero(self, ids: np.ndarray) -> None:
        # The stream is synchronised before returning, like every operation: a client writes the new owner's KV
        # through its own mapping on its own stream as soon as it has the plan, and a zero still in flight would
        # erase it.
        self._start_zero(ids)
        self._wait()

    def _start_copy(self, pairs: np.ndarray) -> None:
        """Enqueue the copies on this pool's stream and return (``_wait`` waits for them): a ShardedPool starts
        every shard's copies before it waits for any, so the devices (or one device's streams) overlap."""
        c = len(pairs)
        self._pairs_host[: 2 * c] = pairs.reshape(-1)
        with self.device:
            cupy.cuda.runtime.memcpyAsync(self._pairs.data.ptr, self._pairs_pinned.ptr, 8 * c, _H2D,
                                          self._stream.ptr)
            self.copier.launch(self._base_ptr, self._pairs.data.ptr, c, self._stream)

    def _start_zero(self, ids: np.ndarray) -> None:
        """Enqueue the clearing (``_start_copy``'s twin): one memset per span for one run of consecutive ids, else
        one launch per batch (a batch longer than num_blocks repeats ids and goes in pieces, the stream
        synchronised between pieces, which share the pinned ids buffer)."""
        with self.device:
            if self.zeroes_by_memset(ids):
                z = self.zeroer
                first = self._base_ptr + int(ids[0]) * z.block_stride
                for span in range(z.spans_per_block):
                    cupy.cuda.runtime.memsetAsync(first + span * z.seg_stride, 0, len(ids) * z.span_bytes,
                                                  self._stream.ptr)
                return
            for start in range(0, len(ids), self.num_blocks):
                if start:
                    self._stream.synchronize()  # the previous piece still reads the pinned ids buffer
                piece = ids[start : start + self.num_blocks]
                n = len(piece)
                self._zero_ids_host[:n] = piece
                cupy.cuda.runtime.memcpyAsync(self._zero_ids.data.ptr, self._zero_ids_pinned.ptr, 4 * n, _H2D,
                                              self._stream.ptr)
                self.zeroer.launch(self._base_ptr, self._zero_ids.data.ptr, n, self._stream)

    def _wait(self) -> None:
        with self.device:
            self._stream.synchronize()  # also makes the pinned pairs / ids buffers reusable

    def zeroes_by_memset(self, ids: np.ndarray) -> bool:
        """Whether ``zero_blocks(ids)`` uses cudaMemsetAsync (ids one ascending run, few spans) or the kernel."""
        return zeroes_by_memset(ids, self.zeroer.spans_per_block)

    def _write(self, slots: np.ndarray, data: np.ndarray) -> None:
        raw = data.reshape(len(slots), -1).view(np.uint8)  # [n, token_bytes]
        self._chunked(slots, raw, to_pool=True)

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        raw = out.reshape(len(slots), -1).view(np.uint8)
        self._chunked(slots, raw, to_pool=False)

    def _chunked(self, slots: np.ndarray, raw: np.ndarray, to_pool: bool) -> None:
        """Move tokens between host ``raw`` [n, token_bytes] and the pool, ``staging_tokens`` at a time."""
        tb = self.layout.token_bytes
        with self.device:
            for start in range(0, len(slots), self.staging_tokens):
                m = min(self.staging_tokens, len(slots) - start)
                staging = self._staging[: m * tb]
                self._slots[:m].set(slots[start : start + m], stream=self._stream)
                if to_pool:
                    staging.set(raw[start : start + m].reshape(-1), stream=self._stream)
                self._mover.launch(self._base_ptr, staging.data.ptr, self._slots.data.ptr, m, to_pool, self._stream)
                if not to_pool:
                    staging.get(stream=self._stream, out=raw[start : start + m].reshape(-1))
            self._stream.synchronize()

    def _release(self) -> None:
        with self.device:
            self._stream.synchronize()
        self._pairs = self._staging = self._slots = None
        self._pairs_host = self._pairs_pinned = None
        self._zero_ids = self._zero_ids_host = self._zero_ids_pinned = None
        self._mem = None  # cudaFree, once no view of the pool is alive
