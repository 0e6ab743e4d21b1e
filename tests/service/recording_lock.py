"""RecordingLock: a stand-in for the guard's lock that records how long each hold lasted (tests and
scripts/lock_hold.py put it in place of ``CoreGuard.lock``)."""

from __future__ import annotations

import threading
import time
from typing import Any


class RecordingLock:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holds: list[float] = []
        self._since = 0.0

    def __enter__(self) -> RecordingLock:
        self._lock.acquire()
        self._since = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.holds.append(time.perf_counter() - self._since)
        self._lock.release()
