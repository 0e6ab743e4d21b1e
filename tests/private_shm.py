"""A /dev/shm of a test's own: a holder process in a mount namespace of its own, with a small tmpfs on /dev/shm.

    shm = PrivateShm("64m")                      # pytest.skip(reason) where it cannot be made
    server = server_factory(prefix=shm.prefix)   # the server's shm_open names land in that tmpfs
    os.listdir(shm.path)                         # /proc/<holder>/root/dev/shm: what is there, seen from outside
    shm.run(sys.executable, "-c", code)          # a process of our own inside it (a client mapping by name)
    shm.close()

Servers of other tests on the machine see neither the tmpfs nor its segments (their start-up sweep cannot reach
them), and its size is the test's. Needs root (CAP_SYS_ADMIN for ``mount``) and util-linux's ``unshare`` and
``nsenter``; CI runs as root. ``nsenter --mount`` enters the namespace and execs the command (no fork), so the pid
of the process started is the server's.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess

import pytest


def _die_with_parent() -> None:
    """The holder (and with it the tmpfs, once its servers have gone) ends if the test process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, kept across exec


class PrivateShm:
    def __init__(self, size: str) -> None:
        missing = [tool for tool in ("unshare", "nsenter") if shutil.which(tool) is None]
        if missing:
            pytest.skip(f"a private /dev/shm needs util-linux's {' and '.join(missing)}")
        if os.geteuid() != 0:
            pytest.skip("a private /dev/shm (a tmpfs mounted in a mount namespace of the test's own) needs root")
        script = f"mount -t tmpfs -o size={size},mode=1777 kvpool-test-shm /dev/shm && echo ready && exec sleep 3600"
        self.holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        assert self.holder.stdout is not None
        if self.holder.stdout.readline() != b"ready\n":
            self.holder.wait()
            assert self.holder.stderr is not None
            pytest.skip(f"cannot mount a private /dev/shm here: {self.holder.stderr.read().decode().strip()}")
        self.prefix = ["nsenter", f"--target={self.holder.pid}", "--mount", "--"]
        self.path = f"/proc/{self.holder.pid}/root/dev/shm"

    def names(self) -> set[str]:
        return set(os.listdir(self.path))

    def free_bytes(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def run(self, *command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix, *command], capture_output=True, text=True, timeout=timeout)

    def close(self) -> None:
        """End the holder: the namespace and its tmpfs go with the last process in it."""
        if self.holder.poll() is None:
            self.holder.kill()
        self.holder.wait()
