"""Periodic work on the server's event loop (the idle-stream sweep; lease expiry, later): registered before the
server starts, started with it, stopped at shutdown.

    background.every(0.1, sweep_expired_leases, "leases")   # a plain function, called on the event loop

Each function runs on the event loop thread, like a servicer method, so it may use the manager under the servicer's
lock without further care; it must be quick. An exception is logged and the task goes on at its next tick.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Periodic:
    interval_s: float
    fn: Callable[[], object]
    name: str


class BackgroundTasks:
    def __init__(self) -> None:
        self._periodic: list[Periodic] = []
        self._tasks: list[asyncio.Task] = []

    def every(self, interval_s: float, fn: Callable[[], object], name: str = "") -> None:
        """Call ``fn()`` every ``interval_s`` seconds while the server runs (registered before ``start``)."""
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        periodic = Periodic(interval_s, fn, name or getattr(fn, "__name__", "task"))
        self._periodic.append(periodic)
        if self._tasks:  # already running: start this one too
            self._tasks.append(asyncio.get_running_loop().create_task(self._run(periodic)))

    def start(self) -> None:
        """On the event loop: start every registered task."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(p), name=f"kvpool-{p.name}") for p in self._periodic]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    @staticmethod
    async def _run(periodic: Periodic) -> None:
        while True:
            await asyncio.sleep(periodic.interval_s)
            try:
                periodic.fn()
            except Exception:
                logger.exception("background task %s failed", periodic.name)
