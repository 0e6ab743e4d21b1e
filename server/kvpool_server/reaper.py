"""Reaper: the thread that ends sessions whose lease has passed, every ``REAP_INTERVAL_S`` (so a hung client's
sequences are freed within its TTL plus that interval)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)
REAP_INTERVAL_S = 0.1


class Reaper:
    def __init__(self, reap: Callable[[], int], interval_s: float = REAP_INTERVAL_S) -> None:
        self._reap = reap
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more reaping after the one in progress (not waited for: it may be waiting for the servicer's lock)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._reap()
            except Exception:  # a bug must not stop reclamation for good
                logger.exception("reaping expired sessions failed")
