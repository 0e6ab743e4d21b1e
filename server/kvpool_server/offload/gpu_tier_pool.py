"""GpuTierPool: the host tier of a ``GpuPool`` in pinned host memory, copied by the copy engines.

    chunks      cupy.cuda.alloc_pinned_memory, ``chunk_bytes`` each, on a background thread (the GPU tier serves
                meanwhile: ``TierPool``); slot s is row s % chunk_slots of chunk s // chunk_slots
    streams     one non-blocking stream per direction (D2H offloads, H2D restores): ``cudaMemcpyAsync`` uses the
                copy engines, never SMs, so decode kernels are not slowed by a copy
    runs        pairs sorted by pool block; consecutive blocks into consecutive slots of one chunk are one copy
                (block-major: ``k * block_bytes`` at once; layer-major: one 2-D copy per (layer, K/V) span)
    completion  an event recorded after the batch; the call returns once it has completed (``synchronize``), so
                the core commits a slot only when its bytes are there and reuses an evicted block only after its
                offload read it
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from kvpool_server.offload.tier_pool import CopyTicket, InjectedCopyError, TierPool, copy_runs

_H2D, _D2H = 1, 2  # cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost


class GpuTicket(CopyTicket):
    """A write-back queued on the D2H stream: done when its event has completed; ``seconds()`` is the stream's
    time between the events recorded before and after its copies (not the time it queued behind others)."""

    def __init__(self, event: Any, started: Any) -> None:
        super().__init__()
        self.event = event
        self.started = started

    def seconds(self) -> float:
        try:
            return float(cupy.cuda.get_elapsed_time(self.started, self.event)) / 1000.0
        except Exception:  # a figure only: never let it fail the write-back's settling
            return 0.0

    def done(self) -> bool:
        return bool(self.event.done)

    def wait(self) -> bool:
        try:
            self.event.synchronize()
        except Exception:  # a CUDA error of the copies surfaces here
            return False
        return True


class GpuTierPool(TierPool):
    backend = "gpu"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pinned: list[Any] = []  # the PinnedMemory of each chunk (keeps it alive)
        with self.pool.device:
            self._d2h = cupy.cuda.Stream(non_blocking=True)
            self._h2d = cupy.cuda.Stream(non_blocking=True)
            self._done = {True: cupy.cuda.Event(disable_timing=True), False: cupy.cuda.Event(disable_timing=True)}

    def _allocate_chunk(self, nbytes: int) -> np.ndarray:
        with self.pool.device:
            mem = cupy.cuda.alloc_pinned_memory(nbytes)
        self._pinned.append(mem)
        return np.frombuffer(mem, dtype=np.uint8, count=nbytes)

    def _move(self, pairs: np.ndarray, to_host: bool) -> None:
        with self.pool.device:
            stream = self._issue(pairs, to_host)
            done = self._done[to_host]
            done.record(stream)
            done.synchronize()

    def _start(self, pairs: np.ndarray) -> CopyTicket:
        """A write-back: the copies queued on the D2H stream, an event of its own after them; no wait."""
        if self._should_fail(True):
            try:
                self._fail_halfway(pairs, True)
            except InjectedCopyError:
                return CopyTicket(ok=False)
        with self.pool.device:
            started = cupy.cuda.Event()  # timing on: the ticket's seconds()
            started.record(self._d2h)
            try:
                stream = self._issue(pairs, to_host=True)
            except Exception:
                return CopyTicket(ok=False)
            event = cupy.cuda.Event()
            event.record(stream)
        return GpuTicket(event, started)

    def _issue(self, pairs: np.ndarray, to_host: bool) -> Any:
        """Queue the copies of ``pairs`` (pool block, host slot) on the direction's stream; returns the stream."""
        layout, pool = self.layout, self.pool
        stream = self._d2h if to_host else self._h2d
        block_stride, seg_stride = layout.strides(pool.num_blocks)
        seg, spans, slot_bytes = layout.segment_bytes, 2 * layout.num_layers, self.slot_bytes
        base = pool._base_ptr
        memcpy, memcpy2d = cupy.cuda.runtime.memcpyAsync, cupy.cuda.runtime.memcpy2DAsync
        # under the caller's ``with pool.device``
        for block, slot, n in copy_runs(pairs[:, 0], pairs[:, 1], self.chunk_slots):
            chunk = self.chunks[slot // self.chunk_slots]
            host = chunk.ctypes.data + (slot % self.chunk_slots) * slot_bytes
            dev = base + block * block_stride
            if not layout.layer_major:  # a run of blocks is one contiguous span on both sides
                if to_host:
                    memcpy(host, dev, n * slot_bytes, _D2H, stream.ptr)
                else:
                    memcpy(dev, host, n * slot_bytes, _H2D, stream.ptr)
                continue
            for span in range(spans):  # span i of n consecutive blocks: contiguous in the pool, strided on host
                h, d = host + span * seg, dev + span * seg_stride
                if to_host:
                    memcpy2d(h, slot_bytes, d, seg, seg, n, _D2H, stream.ptr)
                else:
                    memcpy2d(d, seg, h, slot_bytes, seg, n, _H2D, stream.ptr)
        return stream

    def _release(self) -> None:
        with self.pool.device:
            self._d2h.synchronize()
            self._h2d.synchronize()
        self._pinned = []
