"""EventFeed: the prefix cache's KV events (``core.kv_events.KVEventLog``), published and followed (SubscribeEvents).

The log is filled under the core's lock by the mutations (sealing stores blocks, allocation evicts them) and
published at the end of each (``guard.CoreGuard.mutate`` calls ``publish``), which wakes every subscriber. A subscriber gets a snapshot
first -- unless ``from_seq`` resumes within the buffer -- then each batch in order; one that falls behind the
bounded buffer gets a fresh snapshot (its ``num_dropped`` says so). ``follow`` is that
subscription, transport-neutral (an async iterator of batches); the gRPC handler writes them. Subscribers are not
``OpenStreams`` entries: they are idle by design (no events, no progress), so the idle sweep must not end them;
they end when the client cancels or the server drains (checked every ``POLL_S``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable

from kvpool_server.core.kv_events import DEFAULT_EVENT_LOG_BYTES, EventBatch, KVEventLog
from kvpool_server.core.prefix_cache import PrefixCache
from kvpool_server.service.errors import TooManyStreamsError

POLL_S = 0.5


class EventFeed:
    """The event log, the wake-up of its subscribers, and their cap."""

    def __init__(self, epoch: int, cache: PrefixCache, capacity: int = 10_000, medium: str = "",
                 max_subscribers: int = 64, max_bytes: int = DEFAULT_EVENT_LOG_BYTES) -> None:
        self.log = KVEventLog(epoch, capacity, max_bytes)  # --event-buffer-batches, --event-buffer-bytes
        self.log.attach(cache)
        self.cache = cache
        self.medium = medium  # "GPU" or "CPU": where the pool is (vLLM's kv_events field)
        self.max_subscribers = max_subscribers  # --max-event-subscribers
        self.num_subscribers = 0  # open SubscribeEvents streams (on the loop thread only)
        self._published: asyncio.Event | None = None  # made on the loop, on first use

    def publish(self) -> None:
        """After a mutation, under the lock, on the loop thread: close its events into a batch, wake subscribers."""
        if self.log.pending and self.log.publish() is not None and self._published is not None:
            self._published.set()
            self._published = None

    def waiter(self) -> asyncio.Event:
        if self._published is None:
            self._published = asyncio.Event()
        return self._published

    async def follow(self, lock: threading.Lock, from_seq: int | None, epoch: int | None,
                     stopping: Callable[[], bool]) -> AsyncGenerator[tuple[EventBatch, int], None]:
        """One subscriber: (batch, num_dropped) pairs -- a snapshot first, unless ``from_seq`` of this ``epoch``
        resumes within the buffer -- until ``stopping()``. Refuses (TooManyStreamsError) past the cap."""
        if self.num_subscribers >= self.max_subscribers:
            raise TooManyStreamsError(
                f"kvpool-server already has {self.num_subscribers} SubscribeEvents streams open, its limit "
                f"(--max-event-subscribers={self.max_subscribers}, KVPOOL_MAX_EVENT_SUBSCRIBERS): close one, "
                "or raise the limit")
        self.num_subscribers += 1
        try:
            next_seq = from_seq if from_seq is not None else -1
            if epoch is not None and epoch != self.log.epoch:
                next_seq = -1  # from_seq numbers another start's batches
            while not stopping():
                waiter = self.waiter()
                with lock:
                    batches = self.log.since(next_seq) if next_seq >= 0 else None
                    if batches is None:
                        batches = [self.log.snapshot(self.cache)]
                    num_dropped = self.log.num_dropped
                for batch in batches:
                    yield batch, num_dropped
                    next_seq = batch.seq + 1
                if next_seq < 0:
                    next_seq = self.log.next_seq
                try:
                    await asyncio.wait_for(waiter.wait(), POLL_S)
                except TimeoutError:
                    pass
        finally:
            self.num_subscribers -= 1
