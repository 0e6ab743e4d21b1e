"""A large body read from gRPC only once the byte budget admits it, so that the bodies in server memory are bounded
by ``--max-inflight-bytes`` however many arrive at once.

A unary handler gets its request after gRPC has received all of it: 16 concurrent 64 MiB WriteKVs were all in
memory (~1 GB) before the first was charged. A method with a bulk field (WriteKV) is therefore registered as
stream-unary (the client's unary call is the same on the wire), and its handler charges the most a body may be
(``--max-message-bytes``, its size is not known yet) before it asks gRPC for the message::

    charge = Charge(budget)
    raw = await read_admitted(context, charge, rpc, max_wait_s)   # waits its turn, then reads; charge.num_bytes
    ...                                                            # is then len(raw) (0 for a small body)
    charge.release()                                               # once the call (and its copy) has ended

Until its read starts, a body stays in the sender's socket and gRPC's flow-control window of its stream: 64 KiB
with ``grpc.http2.bdp_probe`` off (``server.grpc_options``; with BDP probing each waiting stream's window grew to
several MiB). Measured: 16 such calls waiting added 1 MiB to a server. So large bodies in memory are at most the
budget (a body is held twice for a moment while gRPC hands it over, its buffer then freed), plus 64 KiB for each
waiting call, of which there are at most ``byte_budget.MAX_UNREAD_WAITERS``.

A sender that stalls holds its charge: its read is bounded by ``MAX_READ_S`` (and the call's deadline), then it is
refused RESOURCE_EXHAUSTED and the charge goes to the next.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from kvpool_server.core import InvalidArgumentError
from kvpool_server.service.byte_budget import BIG_MESSAGE_BYTES, ByteBudget
from kvpool_server.service.errors import TooManyBytesError

MAX_READ_S = 30.0  # the longest one admitted body may take to arrive (64 MiB at ~20 Mbit/s)


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
                        reserve: int) -> bytes:
    """The call's one request message, read once ``charge`` holds ``reserve`` (the most it may be: the largest
    message gRPC takes) of the budget; then it holds the message's size (or
    nothing, for a body under ``BIG_MESSAGE_BYTES``). Raises TooManyBytesError when it cannot be admitted in
    ``max_wait_s`` or does not arrive in ``MAX_READ_S``; InvalidArgumentError when the client sent no message."""
    await charge.budget.acquire(reserve, rpc, max_wait_s, unread=True)
    charge.num_bytes = reserve
    try:
        async with asyncio.timeout(MAX_READ_S):
            raw = await context.read()
    except TimeoutError:
        raise TooManyBytesError(f"{rpc}: the request body did not arrive within {MAX_READ_S:g} s of being "
                                "admitted (a body being received holds its share of --max-inflight-bytes)") from None
    if raw is grpc.aio.EOF or not isinstance(raw, bytes):
        raise InvalidArgumentError(f"{rpc}: the call carried no request message")
    charge.keep(len(raw) if len(raw) > BIG_MESSAGE_BYTES else 0)
    return raw
