"""AsyncKVPoolClient: KVPoolClient's API on grpc.aio, for callers that live in an asyncio event loop.

Same methods, arguments, results (types.py), exceptions (errors.py) and policy as the sync client: every call has
a deadline (the client's ``timeout`` unless the call passes its own); only the idempotent reads (Stats,
GetBlockTable, DescribePool, ReadKV, CheckInvariants, Health) are retried, only on UNAVAILABLE, with the same
RetryPolicy backoff inside the same deadline. Requests and results go through convert.py, as the sync client's do.

    async with AsyncKVPoolClient("unix:/tmp/kvpool.sock") as client:
        a, b = await asyncio.gather(client.register(), client.register())   # concurrent calls on one channel
        result = await client.append([a, b], [20, 7])
        kv = await client.read_kv(a)
        await client.free([a, b])

Differences from KVPoolClient: every method is a coroutine, ``layout`` included (``await client.layout()``: a
property cannot await); ``close()`` is a coroutine and the context manager is ``async with``; there is no
``attach()`` (mapping the pool is local, blocking work: use a KVPoolClient's ``attach()``, whose AttachedPool works
with the slot mappings this client returns) and no ``append_stream()`` (unary ``append()`` only). Make the client
inside the event loop that uses it (grpc.aio binds a channel to one loop); it is not thread-safe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import convert
from kvpool_client.client import RetryPolicy, backoff_after, time_left
from kvpool_client.errors import DeadlineExceededError, UnavailableError
from kvpool.layout import KVLayout
from kvpool_client.types import AppendResult, BlockTable, InvariantReport, PoolDescription, PoolStats


class AsyncKVPoolClient:
    """One grpc.aio channel to a kvpool server; any number of calls may be in flight on it at once."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._channel = channel or grpc.aio.insecure_channel(target, options=convert.channel_options(options))
        self._stub = pb_grpc.KVPoolServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._description: PoolDescription | None = None

    # ---------------------------------------------------------------- plumbing
    async def _call(
        self, name: str, request: Any, *, idempotent: bool, timeout: float | None, rpc: Callable | None = None
    ):
        rpc = rpc or getattr(self._stub, name)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempts = self.retry.max_attempts if idempotent else 1
        for attempt in range(attempts):
            try:
                return await rpc(request, timeout=time_left(deadline, name))
            except grpc.RpcError as error:  # grpc.aio.AioRpcError
                pause = backoff_after(error, name, attempt, attempts, self.retry, deadline)
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- sequences
    async def register(self, seq_id: int | None = None, *, timeout: float | None = None) -> int:
        """Create an empty sequence; the server assigns the id (never reused) unless ``seq_id`` is given."""
        request = convert.register_request(seq_id)
        return (await self._call("RegisterSequence", request, idempotent=False, timeout=timeout)).seq_id

    async def append(
        self,
        seq_ids: int | Sequence[int] | np.ndarray,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        *,
        timeout: float | None = None,
    ) -> AppendResult:
        """Grow every sequence of ``seq_ids`` by ``num_tokens`` (one count for all, or one each), atomically."""
        ids, counts, counts_field = convert.append_args(seq_ids, num_tokens, "AppendToken")
        request = pb.AppendTokenRequest(seq_ids=ids, num_tokens=counts_field)
        response = await self._call("AppendToken", request, idempotent=False, timeout=timeout)
        return convert.append_result(ids, counts, response)

    async def fork(
        self,
        parent_seq_id: int,
        num_children: int = 0,
        child_seq_ids: Sequence[int] = (),
        *,
        timeout: float | None = None,
    ) -> list[int]:
        """Children that share every block of the parent (copy-on-write); returns their ids."""
        request = convert.fork_request(parent_seq_id, num_children, child_seq_ids)
        return list((await self._call("Fork", request, idempotent=False, timeout=timeout)).child_seq_ids)

    async def free(self, seq_ids: int | Sequence[int], *, timeout: float | None = None) -> int:
        """Release sequences (all or none); returns the number of blocks whose ref count reached 0."""
        request = convert.free_request(seq_ids)
        return (await self._call("Free", request, idempotent=False, timeout=timeout)).num_blocks_freed

    # ---------------------------------------------------------------- reads (retried on UNAVAILABLE)
    async def stats(self, *, timeout: float | None = None) -> PoolStats:
        return convert.pool_stats(await self._call("Stats", pb.StatsRequest(), idempotent=True, timeout=timeout))

    async def block_table(self, seq_id: int, *, timeout: float | None = None) -> BlockTable:
        request = pb.GetBlockTableRequest(seq_id=seq_id)
        return convert.block_table(await self._call("GetBlockTable", request, idempotent=True, timeout=timeout))

    async def describe_pool(self, *, timeout: float | None = None) -> PoolDescription:
        r = await self._call("DescribePool", pb.DescribePoolRequest(), idempotent=True, timeout=timeout)
        self._description = convert.pool_description(r)
        return self._description

    async def layout(self) -> KVLayout:
        """The pool's layout (fetched once: it is fixed for the life of a server)."""
        return (self._description or await self.describe_pool()).layout

    async def read_kv(
        self, seq_id: int, start: int = 0, num_tokens: int = 0, *, timeout: float | None = None
    ) -> np.ndarray:
        """KV of tokens [start, start + num_tokens) (0: to the end) as [n, num_layers, 2, num_kv_heads, head_dim]."""
        request = convert.read_kv_request(seq_id, start, num_tokens)
        r = await self._call("ReadKV", request, idempotent=True, timeout=timeout)
        return convert.kv_array(r, await self.layout())

    async def check_invariants(self, *, timeout: float | None = None) -> InvariantReport:
        """The server's full invariant check; a violation raises InternalError with the server's message."""
        r = await self._call("CheckInvariants", pb.CheckInvariantsRequest(), idempotent=True, timeout=timeout)
        return convert.invariant_report(r)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard health check's status name: "SERVING", "NOT_SERVING", ..."""
        request = convert.health_request(service)
        r = await self._call("Health.Check", request, idempotent=True, timeout=timeout, rpc=self._health.Check)
        return convert.health_status(r)

    async def wait_until_serving(self, timeout: float = 10.0, service: str = "") -> None:
        """Wait until health says SERVING; raise DeadlineExceededError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = await self.health(service, timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except (UnavailableError, DeadlineExceededError) as error:
                last = str(error)
            await asyncio.sleep(0.05)
        raise DeadlineExceededError(f"server at {self.target} not SERVING after {timeout}s ({last})", method="Health")

    # ---------------------------------------------------------------- KV through the page table (remote path)
    async def write_kv(self, seq_id: int, start: int, data: np.ndarray, *, timeout: float | None = None) -> int:
        """Write ``data`` ([n, num_layers, 2, num_kv_heads, head_dim], the pool's storage dtype) to tokens
        [start, start + n) of a sequence; returns n. The tokens' blocks must be the sequence's own."""
        request = convert.write_kv_request(seq_id, start, data, await self.layout())
        return (await self._call("WriteKV", request, idempotent=False, timeout=timeout)).num_tokens_written

    # ---------------------------------------------------------------- lifetime
    async def close(self) -> None:
        """Close the channel; calls still in flight are cancelled."""
        await self._channel.close()

    async def __aenter__(self) -> AsyncKVPoolClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
