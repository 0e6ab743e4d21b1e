"""Process-wide tuning of the server process, done once at start-up: pin its threads to CPUs (the garbage
collector's policy is ``gc_policy.py``)."""

from __future__ import annotations

import os


def pin_threads(cpus: frozenset[int]) -> None:
    """Restrict every thread of this process (those grpc started at import included) to ``cpus``; threads started
    later inherit the mask from the thread that starts them. Repeats until a pass finds no thread it had not seen,
    since a thread not yet pinned may start another one meanwhile."""
    os.sched_setaffinity(0, cpus)
    pinned: set[int] = set()
    for _ in range(10):
        try:
            thread_ids = {int(tid) for tid in os.listdir("/proc/self/task")}
        except OSError:
            return
        if thread_ids <= pinned:
            return
        for tid in thread_ids - pinned:
            try:
                os.sched_setaffinity(tid, cpus)
            except ProcessLookupError:  # the thread has ended
                pass
        pinned |= thread_ids
