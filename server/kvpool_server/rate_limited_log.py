"""RateLimitedLog: at most one log line per interval for one kind of event a peer can cause at will (a malformed
request in a flood), with the count of those suppressed since the last line -- the log stays bounded whatever a
peer sends.

    malformed = RateLimitedLog(logger, "ignored a KV event replay request", interval_s=10.0)
    malformed.warning("of %d frames", 7)   # logged; the next ones within 10 s are only counted
    malformed.flush()                      # at shutdown: "... (N more suppressed)" if some were
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """One line per ``interval_s`` at most: the first event of an interval is logged with the number suppressed
    since the last line; the others are counted (``num_events``, ``num_suppressed``). Not thread-safe: one
    thread logs through it."""

    def __init__(self, logger: logging.Logger, what: str, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.what, self.interval_s, self.clock = logger, what, interval_s, clock
        self.num_events = 0
        self.num_suppressed = 0  # since the last line
        self._last_line = -float("inf")

    def warning(self, detail: str, *args: object) -> bool:
        """Count the event; log it if the last line is ``interval_s`` old. True when logged."""
        self.num_events += 1
        now = self.clock()
        if now - self._last_line < self.interval_s:
            self.num_suppressed += 1
            return False
        suppressed, self.num_suppressed, self._last_line = self.num_suppressed, 0, now
        tail = f" ({suppressed} more suppressed in the last {self.interval_s:g} s)" if suppressed else ""
        self.logger.warning(f"{self.what} {detail}{tail}", *args)
        return True

    def flush(self) -> None:
        """Log the count of events suppressed since the last line, if any (at shutdown)."""
        if self.num_suppressed:
            self.logger.warning("%s %d more suppressed (%d in all)", self.what, self.num_suppressed, self.num_events)
            self.num_suppressed = 0
