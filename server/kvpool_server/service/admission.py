"""Admission: which calls are in flight, and the refusal of new ones once shutdown has begun (SIGTERM).

(Not the Drain RPC, ``kvctl drain``: that one stops new sessions and lets live ones finish; see sessions.py.)

Every RPC (every AppendTokenStream message) is ``admit()``-ed before it runs and ``release()``-d once its response
is on its way; ``start()`` (shutdown) makes every later ``admit()`` refuse with UNAVAILABLE::

    serving     admit -> +1 ... release -> -1
    draining    admit -> +1, raises ServerShuttingDownError ... release -> -1   (the caller's finally)
                shutdown waits until no call was refused for a while (wait_quiet), then until
                num_in_flight is 0 (wait_idle)

Invariant: ``num_in_flight`` is the number of ``admit()`` calls not yet matched by a ``release()``, refused ones
included (a refused call is still counted until its status has been sent).
"""

from __future__ import annotations

import threading
import time
from typing import NoReturn

from kvpool_server.service.errors import ServerShuttingDownError


class Admission:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_in_flight = 0
        self._draining = False
        self._last_refused_at = 0.0  # time.monotonic() of the last refusal (or of start())

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def quiet_since(self) -> float:
        """``time.monotonic()`` of the last refused call, or of ``start()`` if none was refused since."""
        return self._last_refused_at

    def admit(self) -> None:
        """Count one call in flight -- the caller must ``release()`` it, even when this raises -- and refuse it
        (ServerShuttingDownError, i.e. UNAVAILABLE) while draining."""
        with self._lock:
            self._num_in_flight += 1
        if self._draining:
            self.refuse()

    def release(self) -> None:
        with self._lock:
            self._num_in_flight -= 1

    def refuse(self) -> NoReturn:
        self._last_refused_at = time.monotonic()
        raise ServerShuttingDownError("kvpool-server is shutting down and takes no new calls")

    def start(self) -> None:
        """Begin draining: from now on every call is refused."""
        self._last_refused_at = time.monotonic()
        self._draining = True

    def wait_quiet(self, quiet_s: float, max_s: float) -> None:
        """Return once no call has been refused for ``quiet_s``, or ``max_s`` after this call at most."""
        now = started = time.monotonic()
        while now - started < max_s and now - self._last_refused_at < quiet_s:
            time.sleep(quiet_s / 4)
            now = time.monotonic()

    def wait_idle(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the calls in flight to finish; returns how many are still running."""
        end = time.monotonic() + timeout_s
        while self._num_in_flight and time.monotonic() < end:
            time.sleep(0.01)
        return self._num_in_flight
