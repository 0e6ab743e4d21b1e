"""ByteBudget: the bytes of large request bodies held by calls at once (``--max-inflight-bytes``), admitted by
size, first come first served.

A transport charges a large body (over ``BIG_MESSAGE_BYTES``) before it parses it, and releases the charge when
the call has ended -- answered, failed or cancelled, and after any copy it handed to a copy thread has finished::

    await budget.acquire(len(body), rpc, max_wait_s)   # fits: charged at once; else waits, or is refused
    try: ... parse, serve, copy ...
    finally: budget.release(len(body))

Policy: a body that fits what is left is charged at once (unless others wait: no overtaking). One that does not
waits -- asynchronously, in arrival order -- for at most ``max_wait_s`` (the transport passes the smaller of
``MAX_WAIT_S`` and the call's deadline); past it, or past the bound on waiters, it is refused RESOURCE_EXHAUSTED
(``TooManyBytesError``) at once, which frees its body. Two kinds of waiter:

- a body already received (``unread=False``: gRPC hands a unary handler the whole message): it waits while the
  bytes waiting also fit the budget -- at most ``2 * max_bytes`` of such bodies are held;
- a body not yet read (``unread=True``: WriteKV's handler charges the largest message before it reads, see
  grpc_api/admitted_reads.py): it costs only its stream's flow-control window while it waits, so at most
  ``MAX_UNREAD_WAITERS`` wait, whatever their charge.

Either way at most ``max_bytes`` of large bodies are being read, parsed or copied at once.

Invariants (``check``): ``0 <= in_use <= max_bytes``; ``waiting_bytes`` is the sum of the received waiters' sizes
and at most ``max_bytes``; ``num_unread_waiting`` counts the unread ones, at most ``MAX_UNREAD_WAITERS``; the head
waiter does not fit (else it would have been granted).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections import deque
from collections.abc import Callable

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.service.errors import TooManyBytesError

BIG_MESSAGE_BYTES = 1 << 20  # bodies over this are charged (and parsed off the event loop, or without copies)
MAX_WAIT_S = 5.0  # the longest a body waits for room before it is refused
MAX_UNREAD_WAITERS = 64  # bodies not yet read that may wait for room (each costs its stream's 64 KiB window)
TRIM_AFTER_S = 0.25  # once no large body is charged, malloc_trim this much later (after the calls have ended)


class ByteBudget:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # --max-inflight-bytes
        self.in_use = 0
        self.waiting_bytes = 0  # of the waiters whose body is in memory
        self.num_unread_waiting = 0
        self.num_refused = 0
        self._waiters: deque[tuple[int, asyncio.Future, bool]] = deque()  # (bytes, granted, unread)
        self.trim: Callable[[], object] | None = malloc_trim()
        self._trim_soon: asyncio.TimerHandle | None = None

    async def acquire(self, num_bytes: int, rpc: str, max_wait_s: float = MAX_WAIT_S, unread: bool = False) -> None:
        """Charge ``num_bytes`` (on the event loop); the caller must ``release`` it once the call has ended.
        ``unread``: the body is not in memory yet (charged before it is read). Raises TooManyBytesError (nothing
        charged) when it cannot be charged within ``max_wait_s``."""
        if not self._waiters and self.in_use + num_bytes <= self.max_bytes:
            self.in_use += num_bytes
            return
        no_room = (self.num_unread_waiting >= MAX_UNREAD_WAITERS if unread
                   else self.waiting_bytes + num_bytes > self.max_bytes)
        if num_bytes > self.max_bytes or no_room or max_wait_s <= 0:
            self._refuse(num_bytes, rpc, "no room to wait")
        granted = asyncio.get_running_loop().create_future()
        entry = (num_bytes, granted, unread)
        self._waiters.append(entry)
        self._count_waiter(entry, 1)
        try:
            async with asyncio.timeout(max_wait_s):  # (not wait_for: on 3.11 it may swallow a cancellation)
                await asyncio.shield(granted)
        except BaseException as exc:
            if granted.done() and not granted.cancelled():
                self.release(num_bytes)  # granted just as the wait ended: give it back
            else:
                granted.cancel()
                self._waiters.remove(entry)
                self._count_waiter(entry, -1)
                self._grant()  # the head may have left: the next one may fit
            if isinstance(exc, TimeoutError):
                self._refuse(num_bytes, rpc, f"waited {max_wait_s:g} s")
            raise

    def release(self, num_bytes: int) -> None:
        self.in_use -= num_bytes
        self._grant()
        if not self.in_use and self.trim is not None and self._trim_soon is None:
            # the last large body is going (its call ends right after): give its memory back to the OS then
            self._trim_soon = asyncio.get_running_loop().call_later(TRIM_AFTER_S, self._trim_if_idle)

    def _trim_if_idle(self) -> None:
        self._trim_soon = None
        if not self.in_use and self.trim is not None:
            self.trim()

    def _count_waiter(self, entry: tuple[int, asyncio.Future, bool], sign: int) -> None:
        if entry[2]:
            self.num_unread_waiting += sign
        else:
            self.waiting_bytes += sign * entry[0]

    def _grant(self) -> None:
        while self._waiters and self.in_use + self._waiters[0][0] <= self.max_bytes:
            entry = self._waiters.popleft()
            self._count_waiter(entry, -1)
            self.in_use += entry[0]
            entry[1].set_result(None)

    def _refuse(self, num_bytes: int, rpc: str, why: str) -> None:
        self.num_refused += 1
        raise TooManyBytesError(
            f"{rpc}: {self.in_use:,} bytes of large requests are being served and {len(self._waiters)} wait, "
            f"the limit being {self.max_bytes:,} (--max-inflight-bytes, KVPOOL_MAX_INFLIGHT_BYTES); this "
            f"{num_bytes:,}-byte request was refused ({why}): retry later, or send smaller requests"
        ) from None

    def check(self) -> None:
        if not 0 <= self.in_use <= self.max_bytes:
            raise InvariantViolationError(f"byte budget: in_use={self.in_use} outside [0, {self.max_bytes}]")
        if self.waiting_bytes != sum(n for n, _, unread in self._waiters if not unread) or \
                self.waiting_bytes > self.max_bytes:
            raise InvariantViolationError(f"byte budget: waiting_bytes={self.waiting_bytes} is wrong")
        unread = sum(1 for *_, u in self._waiters if u)
        if self.num_unread_waiting != unread or unread > MAX_UNREAD_WAITERS:
            raise InvariantViolationError(f"byte budget: num_unread_waiting={self.num_unread_waiting}, {unread} wait")
        if self._waiters and self.in_use + self._waiters[0][0] <= self.max_bytes:
            raise InvariantViolationError("byte budget: the head waiter fits but was not granted")


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``: hand the free memory at the top of the heaps back to the OS (None elsewhere).
    A large body freed in the middle of a heap otherwise stays resident (glibc keeps what it cannot trim)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)
