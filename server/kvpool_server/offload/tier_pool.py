"""TierPool: the host tier's memory -- block-sized host rows the pool's evicted blocks are copied into and back.

    tier = create_tier_pool(pool, num_slots, on_ready=...)   # (offload/create.py) allocates in chunks, in the background
    tier.offload_blocks(pairs)    # int32 [n, 2] (pool block, host slot): done when it returns, or raises
    tier.restore_blocks(pairs)    # int32 [n, 2] (host slot, pool block): done when it returns, or raises

A host slot holds one block whole: its ``2L`` segments (layer, K/V) one after another, ``block_bytes`` in all,
whatever the pool's order -- one contiguous row per block, so a run of blocks of a block-major pool is one copy.

Serving starts at once: the memory is allocated ``chunk_bytes`` (64 MiB) at a time by a background thread
(pinning 64 GiB took 43 s on the H200 host); ``ready_slots`` grows chunk by chunk and ``on_ready(ready_slots)`` is called after each
(the service hands the new slots to the core's ``HostTier``). A slot is used only once its chunk is there.

Two backends, one logic: ``HostTierPool`` (NumPy copies from a ``HostPool``; what CI runs) and ``GpuTierPool``
(``gpu_tier_pool.py``: pinned memory, ``cudaMemcpyAsync`` on one stream per direction). A copy that raises (a
CUDA error, or the test hook ``inject_failures``) may have moved part of its pairs: the caller treats every pair
as failed (the core aborts the offloads, fences the restored slots), so nothing half-copied is ever matchable.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from kvpool_server.device.pool import KVPool
from kvpool_server.log_limits import RateLimitedLog

logger = logging.getLogger(__name__)
failures_log = RateLimitedLog(logger)  # a tier whose every copy fails logs a line (and traceback) per 10 s
# The host tier is allocated (pinned) this much at a time, by a background thread: whatever one allocation stalls
# is bounded by it (the H200 host pinned ~1.5 GB/s: ~45 ms a chunk, during which another thread's cudaMalloc may
# wait: with 256 MiB chunks an AppendToken during the pinning took 130 ms); a run of copies never crosses a chunk (32 2-MiB
# blocks: 64 MiB a copy, still at the link's speed).
DEFAULT_CHUNK_BYTES = 64 << 20


def copy_runs(blocks: np.ndarray, slots: np.ndarray, chunk_slots: int) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of each run of ``blocks`` (taken in ascending order) whose slots follow
    one another inside one chunk: each run is one copy (block-major) or one per span (layer-major)."""
    order = np.argsort(blocks, kind="stable")
    b, s = blocks[order], slots[order]
    brk = (np.diff(b) != 1) | (np.diff(s) != 1) | (s[1:] // chunk_slots != s[:-1] // chunk_slots)
    starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
    ends = np.concatenate((starts[1:], [len(b)]))
    return [(int(b[i]), int(s[i]), int(j - i)) for i, j in zip(starts.tolist(), ends.tolist())]


class InjectedCopyError(OSError):
    """A copy failure made by the test hook ``TierPool.inject_failures``."""


class CopyTotals(NamedTuple):
    """What the tier's completed copies moved since start, each way, and the seconds they took: bytes / seconds is
    the copy bandwidth. A copy that raised (or a write-back that failed) counts in neither."""

    bytes_offloaded: int = 0
    offload_seconds: float = 0.0
    bytes_restored: int = 0
    restore_seconds: float = 0.0


class CopyTicket:
    """A copy started by ``TierPool.start_offload``: ``wait()`` returns True once it completed, False if it failed
    (then none of its pairs may be trusted). ``seconds()``: how long the copy took, once completed."""

    def __init__(self, ok: bool = True, seconds: float = 0.0) -> None:
        self.ok = ok
        self.nbytes = 0  # set by ``start_offload``
        self._seconds = seconds

    def done(self) -> bool:
        return True

    def wait(self) -> bool:
        return self.ok

    def seconds(self) -> float:
        return self._seconds


class TierPool:
    """``num_slots`` host rows of ``block_bytes`` beside ``pool``, allocated in chunks of ``chunk_slots`` rows.

    Invariants: ``ready_slots`` only grows, up to ``num_slots``; slots below it have their memory; a copy names
    only ready slots and blocks of the pool (``_checked``); copies are serialised (``_lock``); ``copy_totals``
    counts each completed copy once (a write-back when ``settle_writeback`` settles its ticket), under its own
    ``_totals_lock``, so that reading them never waits for a copy.
    """

    backend = ""

    def __init__(self, pool: KVPool, num_slots: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 on_ready: Callable[[int], None] = lambda n: None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_slots}")
        self.pool: Any = pool  # a backend's pool: HostPool (segments) or GpuPool (device, base pointer)
        self.layout = pool.layout
        self.num_slots = int(num_slots)
        self.slot_bytes = pool.layout.block_bytes
        self.chunk_slots = max(1, min(self.num_slots, chunk_bytes // self.slot_bytes))
        self.chunks: list[Any] = []  # [chunk_slots or fewer, 2L, segment_bytes] uint8 each (NumPy views)
        self.ready_slots = 0
        self.on_ready = on_ready
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failures = {True: 0, False: 0}  # the test hook: offloads (True) and restores (False) left to fail
        self._fail_every = 0  # the test hook: every n-th copy fails (0: none)
        self._num_copies = {True: 0, False: 0}  # the test hook: copies so far, per direction (True: offloads)
        self._thread: threading.Thread | None = None
        self._totals = CopyTotals()
        self._totals_lock = threading.Lock()

    @property
    def tier_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def bytes_offloaded(self) -> int:
        return self._totals.bytes_offloaded

    @property
    def bytes_restored(self) -> int:
        return self._totals.bytes_restored

    def copy_totals(self) -> CopyTotals:
        """A snapshot of the completed copies' bytes and seconds."""
        with self._totals_lock:
            return self._totals

    def _count(self, to_host: bool, nbytes: int, seconds: float) -> None:
        """A completed copy of ``nbytes`` that took ``seconds``."""
        with self._totals_lock:
            t = self._totals
            if to_host:
                self._totals = t._replace(bytes_offloaded=t.bytes_offloaded + nbytes,
                                          offload_seconds=t.offload_seconds + seconds)
            else:
                self._totals = t._replace(bytes_restored=t.bytes_restored + nbytes,
                                          restore_seconds=t.restore_seconds + seconds)

    def start(self) -> None:
        """Allocate the chunks on a background thread (``wait_ready`` waits for all of them)."""
        self._thread = threading.Thread(target=self._allocate_all, name="kvpool-host-tier", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready_slots == self.num_slots

    def _allocate_all(self) -> None:
        spans = 2 * self.layout.num_layers
        while self.ready_slots < self.num_slots and not self._closed.is_set():
            n = min(self.chunk_slots, self.num_slots - self.ready_slots)
            try:
                raw = self._allocate_chunk(n * self.slot_bytes)
            except Exception:  # out of (pinnable) memory: the tier stays the size it has reached
                logger.exception("the host tier stops at %d of %d blocks", self.ready_slots, self.num_slots)
                return
            with self._lock:
                if self._closed.is_set():
                    return
                self.chunks.append(raw.reshape(n, spans, self.layout.segment_bytes))
                self.ready_slots += n
            self.on_ready(self.ready_slots)

    def inject_failures(self, count: int = 1, offloads: bool = True, restores: bool = True) -> None:
        """Test hook: the next ``count`` offloads and/or restores move half their pairs, then raise
        InjectedCopyError."""
        self._failures = {True: count if offloads else 0, False: count if restores else 0}

    def fail_every(self, n: int) -> None:
        """Test hook: from now on every ``n``-th copy of each direction (the n-th offload, the n-th restore, ...;
        0: none) moves half its pairs, then raises InjectedCopyError."""
        self._fail_every = n

    def offload_blocks(self, pairs: Any) -> int:
        """Copy pool blocks into host slots, ``pairs`` int32 [n, 2] (pool block, host slot); done when it returns."""
        pairs = self._checked(pairs, block_col=0)
        with self._lock:
            self._check_open()
            start = time.perf_counter()
            self._copy(pairs, to_host=True)
            self._count(True, len(pairs) * self.slot_bytes, time.perf_counter() - start)
        return len(pairs)

    def start_offload(self, pairs: Any) -> CopyTicket:
        """Start copying pool blocks into host slots (a write-back, off the core's lock); the ticket says when it
        completed. The host backend copies at once; the GPU queues the copies on the D2H stream. Settle the
        ticket with ``settle_writeback``."""
        pairs = self._checked(pairs, block_col=0)
        with self._lock:
            self._check_open()
            ticket = self._start(pairs)
        ticket.nbytes = len(pairs) * self.slot_bytes
        return ticket

    def settle_writeback(self, ticket: CopyTicket) -> bool:
        """Wait for a write-back's ticket (once per ticket); True: it completed (its bytes and seconds counted)."""
        ok = ticket.wait()
        if ok:
            self._count(True, ticket.nbytes, ticket.seconds())
        return ok

    def _start(self, pairs: np.ndarray) -> CopyTicket:
        start = time.perf_counter()
        try:
            self._copy(pairs, to_host=True)
        except Exception:
            failures_log.error_of("write-back", "host tier: a write-back of %d blocks failed", len(pairs), exc_info=True)
            return CopyTicket(ok=False)
        return CopyTicket(seconds=time.perf_counter() - start)

    def restore_blocks(self, pairs: Any) -> int:
        """Copy host slots into pool blocks, ``pairs`` int32 [n, 2] (host slot, pool block); done when it returns."""
        pairs = self._checked(pairs, block_col=1)
        with self._lock:
            self._check_open()
            start = time.perf_counter()
            self._copy(pairs[:, ::-1], to_host=False)
            self._count(False, len(pairs) * self.slot_bytes, time.perf_counter() - start)
        return len(pairs)

    def _copy(self, pairs: np.ndarray, to_host: bool) -> None:
        """``pairs`` as (pool block, host slot), either direction; the hook cuts it short."""
        if self._should_fail(to_host):
            self._fail_halfway(pairs, to_host)
        self._move(pairs, to_host)

    def _should_fail(self, to_host: bool) -> bool:
        """The test hook's verdict on the next copy in this direction (counts it)."""
        self._num_copies[to_host] += 1
        every = self._fail_every
        if self._failures[to_host] or (every and self._num_copies[to_host] % every == 0):
            self._failures[to_host] = max(0, self._failures[to_host] - 1)
            return True
        return False

    def _fail_halfway(self, pairs: np.ndarray, to_host: bool) -> None:
        half = pairs[: len(pairs) // 2]
        if len(half):
            self._move(half, to_host)
        raise InjectedCopyError(f"injected failure of a host-tier copy of {len(pairs)} blocks")

    def slot_rows(self, slots: np.ndarray) -> list[tuple[Any, np.ndarray, np.ndarray]]:
        """The slots grouped by chunk: (chunk, positions in ``slots``, rows in the chunk)."""
        chunk_of, row = np.divmod(slots, self.chunk_slots)
        groups = []
        for c in np.unique(chunk_of).tolist():
            where = np.flatnonzero(chunk_of == c)
            groups.append((self.chunks[c], where, row[where]))
        return groups

    def _checked(self, pairs: Any, block_col: int) -> np.ndarray:
        arr = np.asarray(pairs)
        if arr.size == 0:
            return np.zeros((0, 2), dtype=np.int64)
        if arr.ndim != 2 or arr.shape[1] != 2 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"pairs must be an int array of shape [n, 2], got {arr.dtype} {arr.shape}")
        blocks, slots = arr[:, block_col], arr[:, 1 - block_col]
        if blocks.min() < 0 or blocks.max() >= self.pool.num_blocks:
            raise ValueError(f"pairs name pool blocks outside [0, {self.pool.num_blocks})")
        if slots.min() < 0 or slots.max() >= self.ready_slots:
            raise ValueError(f"pairs name host slots outside the {self.ready_slots} ready ones")
        return np.ascontiguousarray(arr, dtype=np.int64)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise RuntimeError("the host tier is closed")

    def close(self) -> None:
        """Stop allocating, release the memory; idempotent."""
        self._closed.set()
        with self._lock:
            self.chunks = []
            self._release()

    # --- backend hooks
    def _allocate_chunk(self, nbytes: int) -> np.ndarray:
        raise NotImplementedError

    def _move(self, pairs: np.ndarray, to_host: bool) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        pass


class HostTierPool(TierPool):
    """The host backend's tier: anonymous memory beside a ``HostPool``, NumPy copies through its segments view. A
    chunk's pages are populated as it is made (``MAP_POPULATE``), as the GPU backend's pinned chunks are: the tier
    takes its memory at start (the start-up check compares it with the available memory), not at some later
    offload."""

    backend = "host"

    def _allocate_chunk(self, nbytes: int) -> np.ndarray:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=np.uint8)  # zeroed; kept by the array

    def _move(self, pairs: np.ndarray, to_host: bool) -> None:
        # One slice assignment per run (no temporary, unlike a fancy-indexed gather), as the GPU backend copies.
        segments, per_chunk = self.pool.segments, self.chunk_slots  # segments: [num_blocks, 2L, segment_bytes]
        for block, slot, n in copy_runs(pairs[:, 0], pairs[:, 1], per_chunk):
            rows = self.chunks[slot // per_chunk][slot % per_chunk : slot % per_chunk + n]
            if to_host:
                rows[...] = segments[block : block + n]
            else:
                segments[block : block + n] = rows
