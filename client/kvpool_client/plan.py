"""A plan: one client call written once, as a generator that yields the steps it needs made and gets their answers.

    def stats(self, *, timeout=None) -> Plan[PoolStats]:
        response = yield from self._call(STATS, pb.StatsRequest(), timeout)   # yields Attempt and Pause steps
        return convert.pool_stats(response)

A plan never touches a channel, a sleep or an event loop. It yields two kinds of step:

    Attempt(rpc, request, timeout)   make one unary call; the response comes back at the yield, or the call's
                                     exception (errors.py) is raised there
    Pause(seconds)                   wait that long (between retries, between health polls)
    Exchange(channel, write, read,   one record over the session's fast-path channel (fast_commands.py); its
             method, timeout)        error reply is raised at the yield as the client's exception

and returns the call's result. ``run`` makes the steps with blocking calls (KVPoolClient), ``run_async`` with
awaited ones (AsyncKVPoolClient): that is all the two clients do differently. psycopg 3 drives its protocol the
same way (generators in psycopg/generators.py; ``wait`` and ``wait_async`` in psycopg/waiting.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, NamedTuple, TypeVar

import grpc

from kvpool_client.errors import KVPoolClientError, from_rpc_error
from kvpool_client.rpcs import Rpc

R = TypeVar("R")


class Attempt(NamedTuple):
    """Make ``rpc`` once with ``request``, with ``timeout`` seconds left of the call's deadline."""

    rpc: Rpc
    request: Any
    timeout: float


class Pause(NamedTuple):
    seconds: float


class Exchange(NamedTuple):
    """One record over a fast-path channel (fastpath.py): ``write(views)``, publish, wait, ``read(views)``; the
    reply's error is raised at the yield as the client's exception."""

    channel: Any
    write: Callable[[Any], None]
    read: Callable[[Any], Any]
    method: str
    timeout: float


Step = Attempt | Pause | Exchange
Plan = Generator[Step, Any, R]
Explain = Callable[[KVPoolClientError], KVPoolClientError]


class Steps:
    """The steps of one plan, in order. Make each inside ``with steps as reply``: the value given to ``reply`` goes
    back to the plan; a grpc.RpcError raised inside is thrown into the plan as the client's exception, and so is
    an Exchange's (the client's exception already). When the iteration ends, ``result`` holds what the plan
    returned."""

    def __init__(self, plan: Plan[Any], explain: Explain | None = None) -> None:
        self._plan = plan
        self._explain = explain
        self._step: Step | None = None
        self._answer: Any = None
        self._error: BaseException | None = None
        self.result: Any = None

    def __iter__(self) -> Steps:
        return self

    def __next__(self) -> Step:
        answer, error, self._answer, self._error = self._answer, self._error, None, None
        try:
            self._step = self._plan.send(answer) if error is None else self._plan.throw(error)
        except StopIteration as done:
            self.result = done.value
            raise StopIteration from None
        return self._step

    def __enter__(self) -> Callable[[Any], None]:
        return self._reply

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _tb: object) -> bool:
        if isinstance(error, KVPoolClientError) and isinstance(self._step, Exchange):
            self._error = error  # a record's error reply, the client's exception already
            return True
        if not isinstance(error, grpc.RpcError):  # grpc.aio.AioRpcError is one too
            return False
        self._error = from_rpc_error(error, self._step.rpc.name)
        if self._explain is not None:
            self._error = self._explain(self._error)
        return True

    def _reply(self, answer: Any) -> None:
        self._answer = answer


def run(plan: Plan[R], make: Callable[[Step], Any], explain: Explain | None = None) -> R:
    """The plan's result, each step made by the blocking ``make`` (a call's response; None for a pause);
    ``explain`` may replace a call's exception before the plan sees it (a failure to connect, explained)."""
    steps = Steps(plan, explain)
    for step in steps:
        with steps as reply:
            reply(make(step))
    return steps.result


async def run_async(plan: Plan[R], make: Callable[[Step], Awaitable[Any]], explain: Explain | None = None) -> R:
    """``run`` for asyncio: each step is awaited."""
    steps = Steps(plan, explain)
    for step in steps:
        with steps as reply:
            reply(await make(step))
    return steps.result
