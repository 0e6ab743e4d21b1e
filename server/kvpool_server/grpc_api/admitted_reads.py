"""A large body read from gRPC only once the byte budget admits it, so that the bodies in server memory are bounded
by ``--max-inflight-bytes`` however many arrive at once.

A unary handler gets its request after gRPC has received all of it: 16 concurrent 64 MiB WriteKVs were all in
memory (~1 GB) before the first was charged. A method with a bulk field (WriteKV) is therefore registered as
stream-unary (the client's unary call is the same on the wire), and its handler charges the most a body may be
(``--max-message-bytes``, its size is not known yet) before it asks gRPC for the message::

    charge = Charge(budget)
    raw = await read_admitted(context, charge, rpc, max_wait_s, reserve, reading)   # waits its turn, then reads;
    ...                                                 # charge.num_bytes is then len(raw) (0 for a small body)
    charge.release()                                    # once the call (and its copy) has ended

Until its read starts, a body stays in the sender's socket and gRPC's flow-control window of its stream: 64 KiB
with ``grpc.http2.bdp_probe`` off (``server.grpc_options``; with BDP probing each waiting stream's window grew to
several MiB). Measured: 16 such calls waiting added 1 MiB to a server. So large bodies in memory are at most the
budget, plus one ``--max-message-bytes`` (the body being handed over is held twice for a moment, gRPC's buffer then
freed), plus 64 KiB for each waiting call, of which there are at most ``byte_budget.MAX_UNREAD_WAITERS``.

One body is read at a time (``reading``, a semaphore of 1 for the method): gRPC's aio server copies a received
message into Python bytes on the event loop (~115 ms for 64 MiB on the 2-core machine, py-spy), so four bodies
read at once made Stats wait behind four copies (0.95-1.2 s; one at a time: 0.12-0.44 s, the burst as fast;
``benchmarks/bench_big_requests.py``).
Copies into the pool still run side by side, up to the budget. A sender that stalls holds the read: its read is
bounded by ``MAX_READ_S``, then it is refused RESOURCE_EXHAUSTED and the next is read; a body waits for its turn at
most ``max_wait_s`` in all (budget and read together).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from kvpool_server.core import InvalidArgumentError
from kvpool_server.service.byte_budget import BIG_MESSAGE_BYTES, ByteBudget
from kvpool_server.service.errors import TooManyBytesError

MAX_READ_S = 10.0  # the longest one admitted body may take to arrive (64 MiB at ~54 Mbit/s)


class Charge:
    """The bytes one call holds of ``budget``: released once, at the call's end or by whoever it is handed to."""

    def __init__(self, budget: ByteBudget) -> None:
        self.budget = budget
        self.num_bytes = 0

    def keep(self, num_bytes: int) -> None:
        """Hold ``num_bytes`` (at most what is held): give the rest back now."""
        self.budget.release(self.num_bytes - num_bytes)
        self.num_bytes = num_bytes

    def hand_over(self) -> Callable[[], None] | None:
        """The release, for whoever keeps the body past the call's handler (an offloaded copy); None: nothing held."""
        held, self.num_bytes = self.num_bytes, 0
        return (lambda: self.budget.release(held)) if held else None

    def release(self) -> None:
        if self.num_bytes:
            self.budget.release(self.num_bytes)
            self.num_bytes = 0


async def read_admitted(context: grpc.aio.ServicerContext, charge: Charge, rpc: str, max_wait_s: float,
                        reserve: int, reading: asyncio.Semaphore) -> bytes:
    """The call's one request message, read once ``charge`` holds ``reserve`` (the most it may be: the largest
    message gRPC takes) of the budget and no other body is being read (``reading``); then ``charge`` holds the
    message's size (or nothing, for a body under ``BIG_MESSAGE_BYTES``). Raises TooManyBytesError when it cannot
    start within ``max_wait_s`` or does not arrive in ``MAX_READ_S``; InvalidArgumentError when the client sent no
    message."""
    loop = asyncio.get_running_loop()
    wait_until = loop.time() + max_wait_s
    await charge.budget.acquire(reserve, rpc, max_wait_s, unread=True)  # at most MAX_UNREAD_WAITERS wait here
    charge.num_bytes = reserve  # then at most budget / reserve calls wait below
    try:
        async with asyncio.timeout(max(0.0, wait_until - loop.time())):
            await reading.acquire()
    except TimeoutError:
        raise TooManyBytesError(f"{rpc}: another request body is being received and this one waited {max_wait_s:g} "
                                "s for its turn (--max-inflight-bytes): retry later") from None
    try:
        async with asyncio.timeout(MAX_READ_S):
            raw = await context.read()
    except TimeoutError:
        raise TooManyBytesError(f"{rpc}: the request body did not arrive within {MAX_READ_S:g} s of being "
                                "admitted (a body being received holds the server's turn to read one)") from None
    finally:
        reading.release()
    if raw is grpc.aio.EOF or not isinstance(raw, bytes):
        raise InvalidArgumentError(f"{rpc}: the call carried no request message")
    charge.keep(len(raw) if len(raw) > BIG_MESSAGE_BYTES else 0)
    return raw
