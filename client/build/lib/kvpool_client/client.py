"""KVPoolClient: a typed, synchronous API over the kvpool.v1 stubs.

Every call carries a deadline (the client's ``timeout`` unless the call passes its own; an ``append_stream()``
has none unless given one). Only idempotent reads
(Stats, GetBlockTable, DescribePool, ReadKV, CheckInvariants, Health) are retried, and only on UNAVAILABLE, with
exponential backoff inside the same deadline: a retried AppendToken, Fork, Register or Free could run twice.
Failed calls raise the exception of errors.py that mirrors the status code. AsyncKVPoolClient (aio.py) is the same
API on grpc.aio; both build requests and parse responses through convert.py.

    with KVPoolClient("unix:/tmp/kvpool.sock") as client:
        seq_id = client.register()
        result = client.append([seq_id], 5)          # 5 prompt tokens -> result.slot_mapping (int64[5])
        pool = client.attach()                       # the pool mapped into this process, no copy
        pool.write_slots(result.slot_mapping, kv)    # kv: [5, num_layers, 2, num_kv_heads, head_dim]
        assert (client.read_kv(seq_id) == kv).all()
        with client.append_stream() as stream:      # a decode loop: one AppendTokenStream, one message a step
            for _ in range(100):
                result = stream.step([seq_id])       # the same AppendResult as client.append([seq_id])
        client.free(seq_id)
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client import convert
from kvpool_client.errors import DeadlineExceededError, UnavailableError, from_rpc_error
from kvpool.layout import KVLayout
from kvpool_client.stream import AppendStream
from kvpool_client.types import AppendResult, BlockTable, InvariantReport, PoolDescription, PoolStats

if TYPE_CHECKING:
    from kvpool_client.attach import AttachedPool


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for idempotent calls that failed with UNAVAILABLE: attempt i waits initial * multiplier**i (capped,
    with +-jitter), and never past the call's deadline."""

    max_attempts: int = 4
    initial_backoff_s: float = 0.05
    multiplier: float = 2.0
    max_backoff_s: float = 1.0
    jitter: float = 0.2

    def backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**attempt)
        return base * (1.0 + random.uniform(-self.jitter, self.jitter))


NO_RETRY = RetryPolicy(max_attempts=1)


def time_left(deadline: float, method: str) -> float:
    """Seconds until ``deadline`` (time.monotonic()); DeadlineExceededError once it has passed."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise DeadlineExceededError("deadline passed while retrying", method=method)
    return remaining


def backoff_after(error: grpc.RpcError, method: str, attempt: int, attempts: int, retry: RetryPolicy,
                  deadline: float) -> float:
    """After a failed attempt: raise its exception unless it is UNAVAILABLE and attempts remain; else the seconds
    to wait before the next one (never past ``deadline``). The sync and asyncio clients share this policy."""
    exc = from_rpc_error(error, method)
    if not isinstance(exc, UnavailableError) or attempt + 1 >= attempts:
        raise exc from None
    return min(retry.backoff(attempt), max(0.0, deadline - time.monotonic()))


class KVPoolClient:
    """One channel to a kvpool server. Thread-safe (gRPC channels are); not fork-safe: make one per process."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float = 10.0,
        retry: RetryPolicy = RetryPolicy(),
        options: Sequence[tuple[str, Any]] = (),
        channel: grpc.Channel | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        self.target = target
        self.timeout = timeout
        self.retry = retry
        self._channel = channel or grpc.insecure_channel(target, options=convert.channel_options(options))
        self._stub = pb_grpc.KVPoolServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._description: PoolDescription | None = None
        self._attached: list[AttachedPool] = []

    # ---------------------------------------------------------------- plumbing
    def _call(self, name: str, request: Any, *, idempotent: bool, timeout: float | None, rpc: Callable | None = None):
        rpc = rpc or getattr(self._stub, name)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempts = self.retry.max_attempts if idempotent else 1
        for attempt in range(attempts):
            try:
                return rpc(request, timeout=time_left(deadline, name))
            except grpc.RpcError as error:
                pause = backoff_after(error, name, attempt, attempts, self.retry, deadline)
            time.sleep(pause)
        raise AssertionError("unreachable")

    # ---------------------------------------------------------------- sequences
    def register(self, seq_id: int | None = None, *, timeout: float | None = None) -> int:
        """Create an empty sequence; the server assigns the id (never reused) unless ``seq_id`` is given."""
        request = convert.register_request(seq_id)
        return self._call("RegisterSequence", request, idempotent=False, timeout=timeout).seq_id

    def append(
        self,
        seq_ids: int | Sequence[int] | np.ndarray,
        num_tokens: int | Sequence[int] | np.ndarray = 1,
        *,
        timeout: float | None = None,
    ) -> AppendResult:
        """Grow every sequence of ``seq_ids`` by ``num_tokens`` (one count for all, or one each), atomically."""
        ids, counts, counts_field = convert.append_args(seq_ids, num_tokens, "AppendToken")
        response = self._call(
            "AppendToken",
            pb.AppendTokenRequest(seq_ids=ids, num_tokens=counts_field),
            idempotent=False,
            timeout=timeout,
        )
        return convert.append_result(ids, counts, response)

    def append_stream(self, *, timeout: float | None = None) -> AppendStream:
        """Open an AppendTokenStream: ``.step(seq_ids, num_tokens)`` is ``append()`` on one long-lived stream.

        ``timeout`` is the whole stream's deadline; by default it has none (a decode loop lives long). Never retried.
        """
        return AppendStream(self._stub.AppendTokenStream, timeout)

    def fork(
        self,
        parent_seq_id: int,
        num_children: int = 0,
        child_seq_ids: Sequence[int] = (),
        *,
        timeout: float | None = None,
    ) -> list[int]:
        """Children that share every block of the parent (copy-on-write); returns their ids."""
        request = convert.fork_request(parent_seq_id, num_children, child_seq_ids)
        return list(self._call("Fork", request, idempotent=False, timeout=timeout).child_seq_ids)

    def free(self, seq_ids: int | Sequence[int], *, timeout: float | None = None) -> int:
        """Release sequences (all or none); returns the number of blocks whose ref count reached 0."""
        request = convert.free_request(seq_ids)
        return self._call("Free", request, idempotent=False, timeout=timeout).num_blocks_freed

    # ---------------------------------------------------------------- reads (retried on UNAVAILABLE)
    def stats(self, *, timeout: float | None = None) -> PoolStats:
        return convert.pool_stats(self._call("Stats", pb.StatsRequest(), idempotent=True, timeout=timeout))

    def block_table(self, seq_id: int, *, timeout: float | None = None) -> BlockTable:
        r = self._call("GetBlockTable", pb.GetBlockTableRequest(seq_id=seq_id), idempotent=True, timeout=timeout)
        return convert.block_table(r)

    def describe_pool(self, *, timeout: float | None = None) -> PoolDescription:
        r = self._call("DescribePool", pb.DescribePoolRequest(), idempotent=True, timeout=timeout)
        self._description = convert.pool_description(r)
        return self._description

    @property
    def layout(self) -> KVLayout:
        """The pool's layout (fetched once: it is fixed for the life of a server)."""
        return (self._description or self.describe_pool()).layout

    def read_kv(self, seq_id: int, start: int = 0, num_tokens: int = 0, *, timeout: float | None = None) -> np.ndarray:
        """KV of tokens [start, start + num_tokens) (0: to the end) as [n, num_layers, 2, num_kv_heads, head_dim]."""
        r = self._call("ReadKV", convert.read_kv_request(seq_id, start, num_tokens), idempotent=True, timeout=timeout)
        return convert.kv_array(r, self.layout)

    def check_invariants(self, *, timeout: float | None = None) -> InvariantReport:
        """The server's full invariant check; a violation raises InternalError with the server's message."""
        r = self._call("CheckInvariants", pb.CheckInvariantsRequest(), idempotent=True, timeout=timeout)
        return convert.invariant_report(r)

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The standard health check's status name: "SERVING", "NOT_SERVING", ..."""
        request = convert.health_request(service)
        r = self._call("Health.Check", request, idempotent=True, timeout=timeout, rpc=self._health.Check)
        return convert.health_status(r)

    def wait_until_serving(self, timeout: float = 10.0, service: str = "") -> None:
        """Block until health says SERVING; raise DeadlineExceededError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                last = self.health(service, timeout=max(0.05, min(1.0, deadline - time.monotonic())))
                if last == "SERVING":
                    return
            except (UnavailableError, DeadlineExceededError) as error:
                last = str(error)
            time.sleep(0.05)
        raise DeadlineExceededError(f"server at {self.target} not SERVING after {timeout}s ({last})", method="Health")

    # ---------------------------------------------------------------- KV through the page table (remote path)
    def write_kv(self, seq_id: int, start: int, data: np.ndarray, *, timeout: float | None = None) -> int:
        """Write ``data`` ([n, num_layers, 2, num_kv_heads, head_dim], the pool's storage dtype) to tokens
        [start, start + n) of a sequence; returns n. The tokens' blocks must be the sequence's own."""
        request = convert.write_kv_request(seq_id, start, data, self.layout)
        return self._call("WriteKV", request, idempotent=False, timeout=timeout).num_tokens_written

    # ---------------------------------------------------------------- zero-copy access
    def attach(self) -> AttachedPool:
        """Map the pool into this process (shared memory or CUDA IPC); closed with the client."""
        from kvpool_client.attach import attach

        pool = attach(self)
        self._attached.append(pool)
        return pool

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        for pool in self._attached:
            pool.close()
        self._attached.clear()
        self._channel.close()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
