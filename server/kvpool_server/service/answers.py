"""How a service method says "not on the event loop" or "not now" -- and the one adapter, ``honour``, through which
every transport (the gRPC unary handler, a stream's message, the fast path's records) turns every answer kind into
its reply.

The answer kinds of a service method:

- a value: encoded at once.
- ``return Offload(work, finish)``: ``work()`` (a big KV copy, a whole-manager check) runs on a copy thread and
  returns the answer (which the transport also encodes there); ``finish()`` then runs on the loop once ``work``
  has ended, whatever happened (even if the call was cancelled meanwhile).
- ``raise Wait(awaitable)``: not now; the transport awaits it and calls the method again (from the start).
- any other exception: raised through ``honour`` and ``Pending.settle`` to the transport's call scope, which gives
  its status (service/errors.py, the one map) -- the same on both transports.

    reply = honour(invoke, encode)                # on the caller's thread: the method called once
    if isinstance(reply, Pending):                # an Offload or a Wait (or ``on_loop``): not final yet
        reply = await reply.settle(executor)      # on the event loop: Waits awaited, the Offload run, encoded

gRPC's handlers call ``honour`` on the loop and await a ``Pending`` there; the fast path's thread calls it
first and hands a ``Pending`` to the loop (its reply is written once settled). A new answer kind is added here,
in ``honour`` and ``Pending.settle``, and no transport can miss it: neither handles a kind itself
(tests/service/test_answer_adapter.py drives every kind through both and fences the transports' sources).
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


def _attempt(invoke: Callable[[], Any]) -> Any:
    """``invoke()``'s answer -- a value or an Offload -- or the ``Wait`` it raised (returned, not raised)."""
    try:
        return invoke()
    except Wait as wait:
        return wait


class Pending:
    """An answer that is not final yet -- an Offload, or a Wait -- or a call to make on the event loop from the
    start (``answer`` None). ``settle()``, on the loop, gives the encoded reply (or raises the method's error);
    ``offloaded`` says, once settled, whether an Offload's work ran (its ``encode`` then ran on the copy thread)."""

    __slots__ = ("invoke", "answer", "encode", "hand_over", "offloaded")

    def __init__(self, invoke: Callable[[], Any], answer: Any, encode: Callable[[Any], Any],
                 hand_over: Callable[[], Callable[[], None] | None] | None) -> None:
        self.invoke, self.answer, self.encode, self.hand_over = invoke, answer, encode, hand_over
        self.offloaded = False

    async def settle(self, executor: Executor | None) -> Any:
        """Each Wait awaited, then the method called again; an Offload's work (and ``encode``) on a copy thread of
        ``executor`` (None: the loop's default), its ``finish`` (and the release ``hand_over()`` gives) on the
        loop once it has ended; a value encoded."""
        answer = self.answer
        if answer is None:
            answer = _attempt(self.invoke)
        while isinstance(answer, Wait):
            await answer.until
            answer = _attempt(self.invoke)
        if isinstance(answer, Offload):
            self.offloaded = True
            return await _offloaded(executor, answer, self.encode,
                                    None if self.hand_over is None else self.hand_over())
        return self.encode(answer)

    def close(self) -> None:
        """Never to be settled (the loop is gone): a Wait's awaitable, a coroutine, is closed unawaited."""
        if isinstance(self.answer, Wait) and asyncio.iscoroutine(self.answer.until):
            self.answer.until.close()


def honour(invoke: Callable[[], Any], encode: Callable[[Any], Any], *,
           hand_over: Callable[[], Callable[[], None] | None] | None = None, on_loop: bool = False) -> Any:
    """The one adapter: ``invoke()`` (a service method's call) -> the encoded reply, or a ``Pending`` to settle
    on the event loop when its answer is an Offload or a Wait. Raises the method's error (the call scope gives
    its status). ``hand_over``: called only when an Offload runs, for the release of what the call holds (the
    copy keeps it). ``on_loop``: do not call it here; a ``Pending`` that calls it on the loop."""
    if on_loop:
        return Pending(invoke, None, encode, hand_over)
    answer = _attempt(invoke)
    if isinstance(answer, (Offload, Wait)):
        return Pending(invoke, answer, encode, hand_over)
    return encode(answer)


async def _offloaded(executor: Executor | None, offload: Offload, encode: Callable[[Any], Any],
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
