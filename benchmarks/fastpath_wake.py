"""Wake primitives, measured: two processes ping-pong, each parked on the primitive (or spinning, or polling with
short sleeps), the peer waking it. Prints p50/p99 of the round trip. docs/fast-path.md has the table; the fast path
uses a unix socket (about a futex's cost, multiplexed by epoll, EOF when the peer dies).

    python benchmarks/fastpath_wake.py KIND [ROUND_TRIPS]     KIND: socket pipe eventfd futex spin sleep
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import sys
import time
from collections.abc import Callable

SYS_FUTEX = 202  # x86_64
FUTEX_WAIT, FUTEX_WAKE = 0, 1


def ping_pong(child: Callable[[int], None], parent: Callable[[int], None], n: int) -> list[float]:
    """Fork; the child runs ``child(k)`` for k in range(n), the parent times ``parent(k)``."""
    if os.fork() == 0:
        for k in range(n):
            child(k)
        os._exit(0)
    times = []
    for k in range(n):
        start = time.perf_counter()
        parent(k)
        times.append(time.perf_counter() - start)
    os.wait()
    return times


def measure(kind: str, n: int) -> list[float]:
    if kind == "socket":
        a, b = socket.socketpair()
        return ping_pong(lambda k: (b.recv(1), b.send(b"x")), lambda k: (a.send(b"x"), a.recv(1)), n)
    if kind == "pipe":
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        return ping_pong(lambda k: (os.read(r1, 1), os.write(w2, b"x")), lambda k: (os.write(w1, b"x"), os.read(r2, 1)),
                         n)
    if kind == "eventfd":
        e1, e2 = os.eventfd(0), os.eventfd(0)
        return ping_pong(lambda k: (os.eventfd_read(e1), os.eventfd_write(e2, 1)),
                         lambda k: (os.eventfd_write(e1, 1), os.eventfd_read(e2)), n)
    shared = mmap.mmap(-1, 4096)
    words = (ctypes.c_uint32 * 2).from_buffer(shared)
    if kind == "futex":
        libc = ctypes.CDLL(None, use_errno=True)
        base = ctypes.addressof(words)

        def wait(i: int, value: int) -> None:
            while words[i] == value:
                libc.syscall(SYS_FUTEX, ctypes.c_void_p(base + 4 * i), FUTEX_WAIT, value, None, None, 0)

        def wake(i: int, value: int) -> None:
            words[i] = value
            libc.syscall(SYS_FUTEX, ctypes.c_void_p(base + 4 * i), FUTEX_WAKE, 1, None, None, 0)

        return ping_pong(lambda k: (wait(0, k), wake(1, k + 1)), lambda k: (wake(0, k + 1), wait(1, k)), n)
    pause = {"spin": None, "sleep": 50e-6}[kind]

    def poll(i: int, value: int) -> None:
        while words[i] == value:
            if pause:
                time.sleep(pause)

    def store(i: int, value: int) -> None:
        words[i] = value

    return ping_pong(lambda k: (poll(0, k), store(1, k + 1)), lambda k: (store(0, k + 1), poll(1, k)), n)


def main() -> None:
    kind = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    times = sorted(measure(kind, n))
    print(f"{kind:10s} p50 {times[len(times) // 2] * 1e6:7.1f} us  p99 {times[int(len(times) * 0.99)] * 1e6:7.1f} us")


if __name__ == "__main__":
    main()
