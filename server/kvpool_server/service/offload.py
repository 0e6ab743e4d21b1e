"""How a service method says "not on the event loop" or "not now" -- answered by every transport the same way.

- ``return Offload(work, finish)``: ``work()`` (a big KV copy, a whole-manager check) runs on a copy thread and
  returns the answer (which the transport also encodes there); ``finish()`` then runs on the loop once ``work``
  has ended, whatever happened (even if the call was cancelled meanwhile).
- ``raise Wait(awaitable)``: not now; the transport awaits it and calls the method again (from the start).

Every transport honours them through the two functions below, on the event loop: ``answer_of`` (a method's answer
once it no longer says Wait) and ``offloaded`` (an Offload's work on a copy thread, its ``finish`` on the loop).
gRPC's unary handler calls the method on the loop itself; the fast path's thread calls it first and hands the
record to the loop only when the answer is an ``Offload`` or a ``Wait`` (``attempt`` returns the Wait it raised).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
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


def attempt(invoke: Callable[[], Any]) -> Any:
    """``invoke()``'s answer -- a value or an Offload -- or the ``Wait`` it raised (returned, not raised)."""
    try:
        return invoke()
    except Wait as wait:
        return wait


async def answer_of(invoke: Callable[[], Any], answer: Any = None) -> Any:
    """The method's answer (a value or an Offload) once it no longer says Wait: each Wait awaited, then ``invoke``
    called again. ``answer``: what an earlier ``attempt(invoke)`` gave (None: call it now)."""
    if answer is None:
        answer = attempt(invoke)
    while isinstance(answer, Wait):
        await answer.until
        answer = attempt(invoke)
    return answer


async def offloaded(executor: Executor, offload: Offload, encode: Callable[[Any], Any],
                    release: Callable[[], None] | None = None) -> Any:
    """Run ``offload.work`` (and ``encode`` of its answer) on a copy thread; ``finish`` (and ``release``) on the
    loop once it has ended, whatever happened."""

    def work_and_encode() -> Any:
        return encode(offload.work())

    done = asyncio.get_running_loop().run_in_executor(executor, work_and_encode)
    finish = offload.finish

    def ended(_: Any) -> None:
        try:
            if finish is not None:
                finish()
        finally:
            if release is not None:
                release()

    done.add_done_callback(ended)
    # shield: a cancelled call must not run ``finish`` (unpin, ...) while ``work`` still runs
    return await asyncio.shield(done)
