"""EventFollower / AsyncEventFollower: keep an EventIndex (events.py) following a server's SubscribeEvents across
dropped connections, server drains and restarts.

    with KVPoolClient("unix:/tmp/kvpool.sock", session=False) as client:
        follower = EventFollower(client).start()            # a thread: subscribe, apply, reconnect
        follower.wait_until(epoch, seq, timeout=5.0)        # the index has applied batch seq of epoch
        blocks = follower.blocks()                          # a copy of index.blocks, taken under the lock
        follower.close()

    for batch in EventFollower(client).batches(): ...      # the same loop in the caller's thread, batch by batch

The loop: subscribe with ``index.from_seq`` (none at first: a snapshot comes first); apply each batch; when the
stream ends (the server drained) or fails with UNAVAILABLE or CANCELLED (the server went away), subscribe again
from where the index stands, after a backoff (``retry``: RetryPolicy's, reset by every batch). The server answers a
resume within its buffer with the batches missed, and one further behind with a snapshot. A batch the index cannot
take (``EventGapError``: a seq gap, or a new epoch without a snapshot, i.e. the server restarted) makes it
resubscribe without ``from_seq``: the restarted server sends its snapshot. Any other error ends the loop, raised as
errors.py's exception (in ``start()``'s thread: kept in ``error`` and raised by ``wait_until``).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

from kvpool.v1 import kvpool_pb2 as pb
from kvpool_client.errors import from_rpc_error
from kvpool_client.events import EventGapError, EventIndex, IndexedBlock
from kvpool_client.retry import RetryPolicy

if TYPE_CHECKING:
    from kvpool_client.aio import AsyncKVPoolClient
    from kvpool_client.client import KVPoolClient

RPC = "SubscribeEvents"
RECONNECT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class _Follower:
    """What both followers share: the index, the lock around it, counters, and the decisions of the loop."""

    def __init__(self, index: EventIndex | None, retry: RetryPolicy) -> None:
        self.index = index if index is not None else EventIndex()
        self.retry = retry
        self.num_reconnects = 0  # subscriptions after the first
        self.num_resyncs = 0  # EventGapError: resubscribed for a snapshot
        self.error: Exception | None = None  # what ended start()'s thread
        self._changed = threading.Condition()
        self._closed = False
        self._call: Any = None
        self._attempt = 0

    def _apply(self, batch: pb.SubscribeEventsResponse) -> bool | None:
        """Apply ``batch``: True applied, False a duplicate, None a gap (the index now asks for a snapshot)."""
        with self._changed:
            try:
                applied = self.index.apply(batch)
            except EventGapError:
                self.index.resync()
                self.num_resyncs += 1
                return None
            self._attempt = 0
            self._changed.notify_all()
            return applied

    def _failed(self, error: grpc.RpcError) -> None:
        """A subscription failed: reconnect (return) or give up (raise)."""
        if not self._closed and error.code() not in RECONNECT_CODES:
            raise from_rpc_error(error, RPC) from None

    def _backoff(self) -> float:
        self.num_reconnects += 1
        self._attempt += 1
        return self.retry.backoff(self._attempt - 1)

    def blocks(self) -> dict[bytes, IndexedBlock]:
        """A copy of the index's blocks (taken under the lock: the follower's thread may be applying a batch)."""
        with self._changed:
            return dict(self.index.blocks)

    def position(self) -> tuple[int | None, int | None]:
        """(epoch, last seq) of the last batch applied."""
        with self._changed:
            return self.index.epoch, self.index.last_seq

    def wait_until(self, epoch: int, seq: int, timeout: float) -> bool:
        """Wait until the index has applied batch ``seq`` (or a later one) of ``epoch``; False on timeout. Raises
        the error that ended the loop, if one did."""
        def reached() -> bool:
            return self.error is not None or (self.index.epoch == epoch and (self.index.last_seq or 0) >= seq)

        with self._changed:
            done = self._changed.wait_for(reached, timeout)
        if self.error is not None:
            raise self.error
        return done


class EventFollower(_Follower):
    """Follows SubscribeEvents of ``client`` (a KVPoolClient; a server restarted at the same address is followed
    too: the channel reconnects) into ``index``. ``batches()`` in the caller's thread, or ``start()`` a thread."""

    def __init__(self, client: KVPoolClient, index: EventIndex | None = None, *,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        super().__init__(index, retry)
        self._subscribe: Callable[..., Any] = functools.partial(client._stub.SubscribeEvents,
                                                                metadata=client._metadata)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def batches(self) -> Iterator[pb.SubscribeEventsResponse]:
        """Subscribe, apply and yield each batch applied, reconnecting, until ``close()``."""
        while not self._closed:
            call = self._call = self._subscribe(self.index.request())
            try:
                for batch in call:
                    applied = self._apply(batch)
                    if applied is None:
                        call.cancel()
                        break
                    if applied:
                        yield batch
            except grpc.RpcError as error:
                self._failed(error)
            except GeneratorExit:  # the caller stopped iterating
                call.cancel()
                raise
            finally:
                self._call = None
            if not self._closed:
                self._stop.wait(self._backoff())

    def start(self) -> EventFollower:
        """Run ``batches()`` in a daemon thread; an error that ends it is kept in ``error``."""
        def run() -> None:
            try:
                for _ in self.batches():
                    pass
            except Exception as exc:  # errors.py's, or a bug: kept for wait_until to raise
                with self._changed:
                    self.error = exc
                    self._changed.notify_all()

        self._thread = threading.Thread(target=run, name="kvpool-events", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following (cancels the subscription); joins the thread ``start()`` made."""
        self._closed = True
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def __enter__(self) -> EventFollower:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEventFollower(_Follower):
    """The same loop for asyncio, on an AsyncKVPoolClient: ``async for batch in follower.batches()``; ``close()``
    from another task ends it."""

    def __init__(self, client: AsyncKVPoolClient, index: EventIndex | None = None, *,
                 retry: RetryPolicy = RetryPolicy()) -> None:
        super().__init__(index, retry)
        self._subscribe: Callable[..., Any] = functools.partial(client._stub.SubscribeEvents,
                                                                metadata=client._metadata)

    async def batches(self) -> AsyncIterator[pb.SubscribeEventsResponse]:
        while not self._closed:
            call = self._call = self._subscribe(self.index.request())
            try:
                async for batch in call:
                    applied = self._apply(batch)
                    if applied is None:
                        call.cancel()
                        break
                    if applied:
                        yield batch
            except grpc.RpcError as error:
                self._failed(error)
            except asyncio.CancelledError:  # close() cancelled the call, or the task itself was cancelled
                if not self._closed:
                    raise
            except GeneratorExit:  # the caller stopped iterating
                call.cancel()
                raise
            finally:
                self._call = None
            if not self._closed:
                await asyncio.sleep(self._backoff())

    def close(self) -> None:
        self._closed = True
        call = self._call
        if call is not None:
            call.cancel()


def fetch_snapshot(client: KVPoolClient, timeout: float = 10.0) -> EventIndex:
    """The server's index now: a fresh subscription's snapshot, applied to a new EventIndex."""
    index = EventIndex()
    call = client._stub.SubscribeEvents(pb.SubscribeEventsRequest(), timeout=timeout, metadata=client._metadata)
    try:
        index.apply(next(call))
    except grpc.RpcError as error:
        raise from_rpc_error(error, RPC) from None
    finally:
        call.cancel()
    return index
