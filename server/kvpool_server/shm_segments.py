"""The server's segments in /dev/shm: names that say who owns them, every page reserved when the segment is made,
and the start-up sweep of those whose owner is dead.

    kvpool-<pid>-<start time>-<pid namespace>-<random>      the host pool (one per shard)
    kvpool-fp-<pid>-<start time>-<pid namespace>-<random>   a fast-path channel, from OpenFastPath until its
                                                            client has connected (then it is unlinked)

Reserved: ``create_segment`` sizes the segment (``ftruncate``, sparse) and then ``posix_fallocate``s it, so tmpfs
allocates every page now or answers ENOSPC (allocating nothing). A sparse segment is a promise tmpfs does not keep:
the first touch of a page past the free space -- by the server or by a client that mapped it -- is SIGBUS, and the
server dies (exit 135). Reserved, a full /dev/shm is an error where the segment is made: the pool at start
(StartupError), a channel at OpenFastPath (RESOURCE_EXHAUSTED; the client goes on over gRPC).

The sweep (``reap_stale_segments``, once at every start): a segment is unlinked only when its name is one of the
two forms above (kvpool's own kind), its pid namespace is this process's, and no process of that pid has that start
time (its owner is provably dead: a reused pid has another start time). Names of another pid namespace (another
container sharing /dev/shm) or of any other form are left alone. A clean exit unlinks a server's own segments, and a
plain crash leaves the pool's to its resource_tracker; the sweep is for the rest -- the whole process group killed
at once (OOM killer, ``kill -9 -PGID``), which takes the tracker too, and channels still pending then.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import re
import secrets
from multiprocessing import resource_tracker

import _posixshmem

from kvpool_server.settings import format_bytes

logger = logging.getLogger(__name__)
SHM_DIR = "/dev/shm"  # where shm_open puts a name (glibc), for every process on the host
POOL_KIND, CHANNEL_KIND = "", "fp-"
_NAME = re.compile(r"kvpool-(?:fp-)?(\d+)-(\d+)-(\d+)-[0-9a-f]+")


class ShmFullError(OSError):
    """/dev/shm has not the room for a segment (ENOSPC from ``posix_fallocate``); nothing was left of it."""

    def __str__(self) -> str:
        return str(self.strerror)  # the message, without "[Errno 28]"


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


def owner_may_live(pid: int, start_time: int) -> bool:
    """False only when provably dead: no process ``pid`` with that start time. A pid whose /proc entry we may not
    read (``hidepid``) but that exists (kill 0 says so) may be it: alive."""
    started = process_start_time(pid)
    if started is not None:
        return started == start_time
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists (EPERM: another user's)
    return True


def segment_name(kind: str = POOL_KIND) -> str:
    """``kvpool-<kind><pid>-<start time>-<pid namespace>-<random>``: enough to tell, later, whether its owner
    lives. ``kind``: POOL_KIND or CHANNEL_KIND."""
    return f"kvpool-{kind}{os.getpid()}-{process_start_time() or 0}-{pid_namespace()}-{secrets.token_hex(6)}"


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def create_segment(name: str, size: int, *, what: str, tracked: bool = False) -> mmap.mmap:
    """Create ``name`` (exclusively, mode 0600) of ``size`` bytes, every page reserved, and map it; the caller
    unlinks it (``unlink_segment``). ``tracked``: registered with this process's resource_tracker, which unlinks it
    if the process dies (the pool; as ``SharedMemory`` does). Raises ShmFullError, naming ``what`` and /dev/shm's
    free space, when it does not fit."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        if tracked:
            resource_tracker.register("/" + name, "shared_memory")
        os.ftruncate(fd, size)
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            free = shm_free_bytes()  # after the failed call gave its pages back
            raise ShmFullError(errno.ENOSPC, f"{what} needs {format_bytes(size)} of {SHM_DIR}, which has "
                                             f"{format_bytes(free)} free") from None
        return mmap.mmap(fd, size)
    except BaseException:
        unlink_segment(name, tracked=tracked)
        raise
    finally:
        os.close(fd)


def unlink_segment(name: str, *, tracked: bool = False) -> None:
    """Unlink ``name`` (gone already: nothing to do); ``tracked``: and tell the resource_tracker it is done."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        pass
    if tracked:
        resource_tracker.unregister("/" + name, "shared_memory")


def reap_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink every kvpool segment (pool or channel) of this pid namespace whose owner process is gone; returns
    their names."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    namespace, reaped = pid_namespace(), []
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None or int(match[3]) != namespace:
            continue
        if owner_may_live(int(match[1]), int(match[2])):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
        except OSError:
            continue
        reaped.append(name)
    if reaped:
        logger.warning("unlinked %d shared-memory segment(s) left by dead servers: %s", len(reaped),
                       ", ".join(reaped))
    return reaped
