"""BlockingAsyncClient: an AsyncKVPoolClient called the way a KVPoolClient is, so that one test body runs against
both clients. The async client lives on an event loop of its own (made there, as grpc.aio requires); each call
runs on that loop to completion. Every call is the real AsyncKVPoolClient's, against the same server."""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any

from kvpool.layout import KVLayout
from kvpool_client import AsyncKVPoolClient


class BlockingAsyncClient:
    def __init__(self, target: str, **settings: Any) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self.aio: AsyncKVPoolClient = self._loop.run_until_complete(self._open(target, settings))
        except BaseException:
            self._loop.close()
            raise

    @staticmethod
    async def _open(target: str, settings: dict[str, Any]) -> AsyncKVPoolClient:
        return AsyncKVPoolClient(target, **settings)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.aio, name)
        if not callable(attr):  # target, timeout, retry, the stubs (tests replace their methods)
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            return self._loop.run_until_complete(result) if inspect.isawaitable(result) else result

        return call

    @property
    def layout(self) -> KVLayout:
        return self._loop.run_until_complete(self.aio.layout())

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.aio.close())
            self._loop.close()
