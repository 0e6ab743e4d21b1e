"""KVPoolClient: the client API (commands.py) with blocking calls on a grpc.Channel, plus what only a blocking
client can do: ``attach()`` the pool into this process and ``append_stream()``.

Every call carries a deadline (the client's ``timeout`` unless the call passes its own; an ``append_stream()``
has none unless given one). Only idempotent reads (rpcs.py) are retried, only on UNAVAILABLE, with backoff
inside the same deadline (retry.py). Failed calls raise the exception of errors.py that mirrors the status code.

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

import functools

import time
from functools import cached_property
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvpool.layout import KVLayout
from kvpool_client import plan
from kvpool_client.errors import InvalidArgumentError
from kvpool_client.fast_commands import FastPathCommands
from kvpool_client.session import KeepAliveThread
from kvpool_client.stream import AppendStream

if TYPE_CHECKING:
    from kvpool_client.attach import AttachedPool
    from kvpool_client.rank_group import RankGroup

R = TypeVar("R")


class KVPoolClient(FastPathCommands):
    """One channel to a kvpool server. Thread-safe (gRPC channels are); not fork-safe: make one per process.

    ``KVPoolClient(target, *, timeout=10.0, retry=RetryPolicy(), options=(), channel=None, fast_path=None)``: see
    commands.py. ``fast_path``: register / append / fork / free go over the session's shared-memory channel when the
    server is on this host (fast_commands.py, docs/fast-path.md); False: always gRPC; None (the default): on, unless
    ``channel`` is given (a caller's own channel, its interceptors, see every call)."""

    @staticmethod
    def _open_channel(
        target: str, options: list[tuple[str, Any]], credentials: grpc.ChannelCredentials | None = None
    ) -> grpc.Channel:
        if credentials is not None:
            return grpc.secure_channel(target, credentials, options=options)
        return grpc.insecure_channel(target, options=options)

    def _run(self, call: plan.Plan[R]) -> R:
        return plan.run(call, self._make, self._explain)

    def _start_keep_alive(self) -> None:
        self._keep_alive = KeepAliveThread(self._session, self._keep_alive_method())
        self._keep_alive.start()

    def _make(self, step: plan.Step) -> Any:
        """One step, blocking: a unary call's response, or a sleep."""
        if isinstance(step, plan.Pause):
            return time.sleep(step.seconds)
        if isinstance(step, plan.Exchange):
            return step.channel.exchange(step)
        return self._stub_method(step.rpc)(step.request, timeout=step.timeout, metadata=self._metadata)

    @property
    def layout(self) -> KVLayout:
        """The pool's layout (fetched once: it is fixed for the life of a server)."""
        return self._run(self._layout())

    def append_stream(self, *, timeout: float | None = None) -> AppendStream:
        """Open an AppendTokenStream: ``.step(seq_ids, num_tokens)`` is ``append()`` on one long-lived stream.

        ``timeout`` is the whole stream's deadline; by default it has none (a decode loop lives long). Never retried.
        """
        session = self._run(self._session_fields("AppendTokenStream"))
        return AppendStream(functools.partial(self._stub.AppendTokenStream, metadata=self._metadata), timeout,
                            session.get("session_id", 0), self._session)

    # ---------------------------------------------------------------- zero-copy access
    def attach(self, rank: int | None = None) -> AttachedPool:
        """Map the pool into this process (shared memory or CUDA IPC); closed with the client.

        A tensor-parallel pool (``describe_pool().tensor_parallel`` N > 1) is N shards split by KV heads: pass this
        process's ``rank`` to map its shard (its ``layout`` has that rank's heads only: ``shards[rank].heads`` of
        the full layout). ``rank`` may be left out only for a pool of one rank."""
        from kvpool_client.attach import attach

        description = self.describe_pool()
        if rank is None and description.tensor_parallel > 1:
            raise InvalidArgumentError(f"the pool is split over {description.tensor_parallel} tensor-parallel ranks: "
                                       "attach(rank=r) maps rank r's shard (attach_ranks(): every rank)",
                                       method="attach")
        try:
            shard = description.for_rank(rank or 0)
        except ValueError as exc:
            raise InvalidArgumentError(str(exc), method="attach") from None
        pool = attach(shard, self._session)
        self._attached.append(pool)
        return pool

    def attach_ranks(self) -> RankGroup | AttachedPool:
        """Every rank's shard mapped into this process, read and written as whole tokens (``RankGroup``); the plain
        ``attach()`` for a pool of one rank."""
        from kvpool_client.rank_group import RankGroup

        description = self.describe_pool()
        if description.tensor_parallel == 1:
            return self.attach()
        return RankGroup(description, [self.attach(rank) for rank in range(description.tensor_parallel)])

    @cached_property
    def _attached(self) -> list[AttachedPool]:
        """The pools ``attach()`` mapped, closed by ``close()``."""
        return []

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Close attached pools, end the session (the server frees its sequences), close the channel."""
        for pool in self._attached:
            pool.close()
        self._attached.clear()
        keep_alive = getattr(self, "_keep_alive", None)
        self._close_fast_path()
        self._run(self._close_session())
        if keep_alive is not None:
            keep_alive.stop()
        self._channel.close()

    def __enter__(self) -> KVPoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
