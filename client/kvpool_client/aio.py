"""AsyncKVPoolClient: the client API (commands.py) with awaited calls on a grpc.aio channel, for callers that
live in an asyncio event loop.

The same methods, arguments, results (types.py), exceptions (errors.py), deadlines and retries (retry.py) as
KVPoolClient: both inherit every call from commands.py and differ only in how a step of it is made.

    async with AsyncKVPoolClient("unix:/tmp/kvpool.sock") as client:
        a, b = await asyncio.gather(client.register(), client.register())   # concurrent calls on one channel
        result = await client.append([a, b], [20, 7])
        kv = await client.read_kv(a)
        await client.free([a, b])

Differences from KVPoolClient: every call returns an awaitable, ``layout`` included (``await client.layout()``: a
property cannot await); ``close()`` is a coroutine and the context manager is ``async with``; there is no
``attach()`` (mapping the pool is local, blocking work: use a KVPoolClient's ``attach()``, whose AttachedPool works
with the slot mappings this client returns) and no ``append_stream()`` (unary ``append()`` only). Make the client
inside the event loop that uses it (grpc.aio binds a channel to one loop); it is not thread-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import grpc

from kvpool.layout import KVLayout
from kvpool_client import plan
from kvpool_client.fast_commands import FastPathCommands
from kvpool_client.session import keep_alive_task

R = TypeVar("R")


class AsyncKVPoolClient(FastPathCommands):
    """One grpc.aio channel to a kvpool server; any number of calls may be in flight on it at once.

    ``AsyncKVPoolClient(target, *, timeout=10.0, retry=RetryPolicy(), options=(), channel=None, fast_path=None)``:
    see commands.py and fast_commands.py (register / append / fork / free over the session's shared-memory channel
    when the server is local; a parked wait is on the event loop)."""

    @staticmethod
    def _open_channel(
        target: str, options: list[tuple[str, Any]], credentials: grpc.ChannelCredentials | None = None
    ) -> grpc.aio.Channel:
        if credentials is not None:
            return grpc.aio.secure_channel(target, credentials, options=options)
        return grpc.aio.insecure_channel(target, options=options)

    def _run(self, call: plan.Plan[R]) -> Awaitable[R]:
        return plan.run_async(call, self._make, self._explain)

    def _start_keep_alive(self) -> None:
        self._keep_alive = asyncio.get_running_loop().create_task(keep_alive_task(self._session,
                                                                                    self._keep_alive_method()))

    async def _make(self, step: plan.Step) -> Any:
        """One step, awaited: a unary call's response, or a sleep."""
        if isinstance(step, plan.Pause):
            return await asyncio.sleep(step.seconds)
        if isinstance(step, plan.Exchange):
            return await step.channel.exchange_async(step)
        return await self._stub_method(step.rpc)(step.request, timeout=step.timeout, metadata=self._metadata)

    async def layout(self) -> KVLayout:
        """The pool's layout (fetched once: it is fixed for the life of a server)."""
        return await self._run(self._layout())

    async def close(self) -> None:
        """End the session (the server frees its sequences) and close the channel; calls in flight are cancelled."""
        keep_alive = getattr(self, "_keep_alive", None)
        self._close_fast_path()
        await self._run(self._close_session())
        if keep_alive is not None:
            keep_alive.cancel()
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
