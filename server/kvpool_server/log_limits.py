"""RateLimitedLog: a failure that can repeat at the rate of the calls (a host-tier copy that always fails, a client
that always sends garbage) is logged once per ``interval_s`` at most, with how many like it were held back::

    failures = RateLimitedLog(logger, interval_s=10.0)
    failures.warning_of("write-back", "host tier: a write-back of %d blocks failed (%s)", n, exc)
    # first: logged at once; the next ones within 10 s: counted; the first after: logged with
    # " (and 443,060 more like it in the last 10 s)"

So the log grows by at most one line (and one traceback, with ``exc_info``) per kind per interval, whatever the
failure rate: a tier whose every offload failed wrote 47 MB of tracebacks in 30 s before this.

Invariant: ``_held[key]`` is the number of messages of ``key`` not logged since the last one that was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

DEFAULT_INTERVAL_S = 10.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # key -> when its last message was logged
        self._held: dict[str, int] = {}

    def log(self, level: int, key: str, message: str, *args: Any, exc_info: Any = None) -> bool:
        """Log ``message % args`` unless one of ``key`` was logged less than ``interval_s`` ago (then it is
        counted, and said with the next one logged). Returns whether it was logged."""
        now = self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            held = self._held.pop(key, 0)
            self._last[key] = now
        if held:
            message += f" (and {held:,} more like it in the last {now - last:.0f} s)"  # type: ignore[operator]
        self.logger.log(level, message, *args, exc_info=exc_info)
        return True

    def warning_of(self, key: str, message: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.WARNING, key, message, *args, exc_info=exc_info)

    def error_of(self, key: str, message: str, *args: Any, exc_info: Any = None) -> bool:
        return self.log(logging.ERROR, key, message, *args, exc_info=exc_info)
