"""HostPool: the pool in POSIX shared memory, for machines without a GPU.

Other processes map it by name (the client library's ``map_host_pool``), the way CUDA IPC maps the GPU pool.

No segment outlives its server for long, whatever kills it. A clean exit unlinks it (``close()``); a plain crash
leaves it to the resource_tracker process, which unlinks it when the server dies. When the whole process group
dies at once (OOM killer, cgroup kill, ``kill -9 -PGID``) the tracker dies too and the name stays; so the name
says who owns it -- ``kvpool-<pid>-<start time>-<pid namespace>-<random>`` -- and every host pool, before it makes
its own, unlinks each kvpool segment whose owner is gone (no process with that pid and that start time in this pid
namespace). See docs/device.md for why not an unnamed segment.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from multiprocessing import shared_memory

import numpy as np

from kvpool.layout import KVLayout, blocks_view, gather_tokens, scatter_tokens, segments_view
from kvpool.shm import open_shm
from kvpool_server.device.pool import KVPool, PoolAttachInfo

logger = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"
_NAME = re.compile(r"kvpool-(\d+)-(\d+)-(\d+)-[0-9a-f]+")


def process_start_time(pid: int | str = "self") -> int | None:
    """The start time of process ``pid`` (clock ticks since boot; /proc/PID/stat field 22), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields after "pid (comm)": state is field 3


def pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name() -> str:
    """``kvpool-<pid>-<start time>-<pid namespace>-<random>``: enough to tell, later, whether its owner lives."""
    return f"kvpool-{os.getpid()}-{process_start_time() or 0}-{pid_namespace()}-{secrets.token_hex(6)}"


def reap_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every kvpool segment of this pid namespace whose owner process is gone; returns their names. Names of
    other namespaces (whose pids mean nothing here) and of other formats are left alone."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    namespace, reaped = pid_namespace(), []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match[3]) != namespace:
            continue
        if process_start_time(match[1]) == int(match[2]):
            continue  # its server is alive
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:
            continue
        reaped.append(name)
    if reaped:
        logger.warning("unlinked %d shared-memory pool(s) left by dead servers: %s", len(reaped), ", ".join(reaped))
    return reaped


RUN_SLICES_MAX = 8  # zero_blocks: up to this many runs as slices (one memset each), else one fancy assignment


def block_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Runs of consecutive block ids, as ``[start, end)`` pairs of int64 arrays, sorted; repeats are dropped."""
    ids = np.unique(ids)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.concatenate(([0], breaks))]
    ends = ids[np.concatenate((breaks - 1, [len(ids) - 1]))] + 1
    return starts.astype(np.int64), ends.astype(np.int64)


class HostPool(KVPool):
    """A shared-memory segment named ``kvpool-<pid>-<start time>-<pid namespace>-<random>``, owned by this object.

    Ownership: this process creates the segment (registered with its resource_tracker, so it is unlinked even if
    the process dies) and is the only one that unlinks it, in ``close()``. The pool's own mapping is a plain
    ``mmap`` of the segment, as in any other process, so arrays still alive after ``close()`` stay valid (the
    pages are freed when the last of them is gone) instead of dangling.
    """

    backend = "host"

    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        super().__init__(layout, num_blocks)
        reap_stale_segments()
        self.shm_name = segment_name()
        # SharedMemory creates the segment and registers it for unlink-at-exit; we map it ourselves.
        owner = shared_memory.SharedMemory(name=self.shm_name, create=True, size=self.pool_bytes)
        self._segment = owner
        try:
            owner.close()  # drop SharedMemory's own mapping; the segment and its tracker registration stay
            self._mmap = open_shm(self.shm_name, self.pool_bytes)
        except BaseException:
            owner.unlink()
            raise
        flat = np.frombuffer(self._mmap, dtype=layout.storage_dtype)
        self.blocks = blocks_view(flat, layout, self.num_blocks)
        # [num_blocks, 2L, segment_bytes]: a block's bytes whatever the order (strided for layer-major)
        self._segments = segments_view(np.frombuffer(self._mmap, dtype=np.uint8), layout, self.num_blocks)

    @property
    def segments(self) -> np.ndarray:
        """The pool's bytes as [num_blocks, 2L, segment_bytes] (the host tier copies through it)."""
        self._check_open()
        return self._segments

    def attach_info(self) -> PoolAttachInfo:
        self._check_open()
        return PoolAttachInfo(backend="host", pool_bytes=self.pool_bytes, shm_name=self.shm_name)

    def _copy(self, pairs: np.ndarray) -> None:
        # Safe as one gather/scatter because no destination is a source of the batch (KVPool's invariant).
        self._segments[pairs[:, 1]] = self._segments[pairs[:, 0]]

    def _zero(self, ids: np.ndarray) -> None:
        # Many ids: one fancy-indexed assignment, whose loop is in C (finding runs first -- a sort -- cost 3x the
        # assignment at 256 scattered blocks). A few ids: one slice per run (a memset per run; 2L strided ones
        # layer-major).
        if ids.size > RUN_SLICES_MAX:
            self._segments[ids] = 0
            return
        starts, ends = block_runs(ids)
        if len(starts) > RUN_SLICES_MAX:
            self._segments[ids] = 0
            return
        for start, end in zip(starts.tolist(), ends.tolist()):
            self._segments[start:end] = 0

    def _write(self, slots: np.ndarray, data: np.ndarray) -> None:
        scatter_tokens(self.blocks, slots, self.layout.block_size, data)

    def _read(self, slots: np.ndarray, out: np.ndarray) -> None:
        out[...] = gather_tokens(self.blocks, slots, self.layout.block_size)

    def _release(self) -> None:
        self._segments = None
        try:
            self._segment.unlink()  # the name goes now; the memory when the last mapping (here or elsewhere) goes
        except FileNotFoundError:
            pass
        try:
            self._mmap.close()
        except BufferError:  # caller still holds arrays of the pool: they keep the pages until they are garbage
            pass
