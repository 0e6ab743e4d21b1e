"""How a service method says "not on the event loop" or "not now" -- answered by every transport the same way.

- ``return Offload(work, finish)``: ``work()`` (a big KV copy, a whole-manager check) runs on a copy thread and
  returns the answer (which the transport also encodes there); ``finish()`` then runs on the loop once ``work``
  has ended, whatever happened (even if the call was cancelled meanwhile).
- ``raise Wait(awaitable)``: not now; the transport awaits it and calls the method again (from the start).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Offload:
    """A service method's answer whose slow part must not run on the event loop."""

    work: Callable[[], Any]
    finish: Callable[[], None] | None = None


class Wait(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a service method that cannot act now: the transport awaits ``until`` and calls it again."""

    def __init__(self, until: Awaitable[Any]) -> None:
        super().__init__("wait")
        self.until = until
