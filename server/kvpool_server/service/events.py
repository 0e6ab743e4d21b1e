"""EventFeed: the prefix cache's KV events (``core.kv_events.KVEventLog``), published and followed (SubscribeEvents).

The log is filled under the core's lock by the mutations (sealing stores blocks, allocation evicts them) and
published at the end of each (``guard.CoreGuard.mutate`` calls ``publish``), which wakes every subscriber. A subscriber gets a snapshot
first -- unless ``from_seq`` resumes within the buffer -- then each batch in order; one that falls behind the
bounded buffer gets a fresh snapshot (its ``num_dropped`` says so). ``follow`` is that
subscription, transport-neutral (an async iterator of batches); the gRPC handler writes them. Subscribers are not
``OpenStreams`` entries: they are idle by design (no events, no progress), so the idle sweep must not end them;
they end when the client cancels or the server drains (checked every ``POLL_S``).

Subscribers are bounded in all and per tenant. At most ``--max-event-subscribers`` follow at once, and with
--auth-tokens at most ``--max-event-subscribers-per-tenant`` of one tenant (the caller's), so that one tenant's idle
subscribers -- reading, so never shed -- cannot lock the others out: past its own bound a tenant's new subscriber
sheds one of the tenant's own blocked subscribers (as below) or is refused. Without --auth-tokens every caller is
the one tenant "", there is no other to protect, and ``--max-event-subscribers`` is the only bound
(``max_subscribers_per_tenant`` None).

Slow consumers are shed. A subscriber that does not read its
stream ends up with its transport blocked on a write (gRPC's flow-control window is full), which ``follow`` sees as
a batch it yielded and was not asked for the next one. When a new subscriber finds the cap reached, it takes the
place of the one blocked the longest -- if that one has been blocked for ``SHED_AFTER_S`` at least -- which ends
with RESOURCE_EXHAUSTED (``SlowSubscriberError``: "too slow, resubscribe with from_seq"). Only when every
subscriber is keeping up is the new one refused (``TooManyStreamsError``). So subscribers that never read cannot
lock a router out for longer than ``SHED_AFTER_S`` once events flow.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

from kvpool_server.core.kv_event_types import BlockStored
from kvpool_server.core.kv_events import DEFAULT_EVENT_LOG_BYTES, EventBatch, KVEventLog
from kvpool_server.core.prefix_cache import PrefixCache
from kvpool_server.service.errors import SlowSubscriberError, TooManyStreamsError

POLL_S = 0.5
SHED_AFTER_S = 1.0  # a subscriber blocked on one write this long may be shed for a new one (at the cap)


@dataclass(eq=False)
class Subscriber:
    """One SubscribeEvents stream: its task, and since when its consumer has held a batch (None: waiting for the
    next one, i.e. keeping up)."""

    task: asyncio.Task | None
    tenant: str = ""
    blocked_since: float | None = None
    shed: SlowSubscriberError | None = None  # set when a new subscriber took its place


class EventFeed:
    """The event log, the wake-up of its subscribers, and their caps.

    Invariant: at most ``max_subscribers`` subscribers, at most ``max_subscribers_per_tenant`` of one tenant when
    that is set (``follow`` makes room or refuses before it adds one)."""

    def __init__(self, epoch: int, cache: PrefixCache, capacity: int = 10_000, medium: str = "",
                 max_subscribers: int = 64, max_bytes: int = DEFAULT_EVENT_LOG_BYTES,
                 max_subscribers_per_tenant: int | None = 16, kept: Callable[[], list[BlockStored]] = list) -> None:
        self.log = KVEventLog(epoch, capacity, max_bytes)  # --event-buffer-batches, --event-buffer-bytes
        self.log.attach(cache)
        self.cache = cache
        # What a keeper of the cache's evictions holds beside it, for a snapshot (the host tier's blocks the pool
        # holds no copy of: ``HostTier.stored_events``).
        self.kept: Callable[[], list[BlockStored]] = kept
        self.medium = medium  # "GPU" or "CPU": where the pool is (vLLM's kv_events field)
        self.max_subscribers = max_subscribers  # --max-event-subscribers
        # --max-event-subscribers-per-tenant with --auth-tokens; None without (one tenant: max_subscribers only)
        self.max_subscribers_per_tenant = max_subscribers_per_tenant
        self._subscribers: dict[asyncio.Task | None, Subscriber] = {}  # open streams (on the loop thread only)
        self._shed: weakref.WeakKeyDictionary[asyncio.Task, SlowSubscriberError] = weakref.WeakKeyDictionary()
        # What subscribers wait on, made on the loop on first use: the event, its loop and that loop's thread.
        self._published: tuple[asyncio.Event, asyncio.AbstractEventLoop, int] | None = None
        # Called with each published batch and its estimated bytes, under the lock, on the loop's thread or the fast
        # path's: must only hand it on, thread-safely (zmq_events.publisher's bounded queue). Appended to under the
        # lock.
        self.sinks: list[Callable[[EventBatch, int], None]] = []

    def snapshot(self) -> EventBatch:
        """The cache's content (and the host tier's) as one batch: ``KVEventLog.snapshot`` (under the guard's lock)."""
        return self.log.snapshot(self.cache, self.kept())

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def shed_error(self, task: asyncio.Task | None) -> SlowSubscriberError | None:
        """Why the subscriber that ran in ``task`` was ended (its transport, seeing the cancellation, ends the
        stream with this status), or None when it was not shed."""
        return self._shed.pop(task, None) if task is not None else None

    def num_subscribers_of(self, tenant: str) -> int:
        return sum(s.tenant == tenant for s in self._subscribers.values())

    def _make_room(self, tenant: str) -> None:
        """Before a subscriber of ``tenant`` joins: at the tenant's cap, shed the tenant's subscriber blocked the
        longest (at least ``SHED_AFTER_S``), else refuse; at the server's cap, the same among all subscribers."""
        now = time.monotonic()
        per_tenant = self.max_subscribers_per_tenant
        of_tenant = self.num_subscribers_of(tenant) if per_tenant is not None else 0
        at_tenant_cap = per_tenant is not None and of_tenant >= per_tenant
        if not at_tenant_cap and self.num_subscribers < self.max_subscribers:
            return
        blocked = [s for s in self._subscribers.values()
                   if s.blocked_since is not None and s.shed is None and now - s.blocked_since >= SHED_AFTER_S
                   and (s.tenant == tenant or not at_tenant_cap)]
        if not blocked and at_tenant_cap:
            raise TooManyStreamsError(
                f"tenant {tenant!r} already has {of_tenant} SubscribeEvents streams open, its limit "
                f"(--max-event-subscribers-per-tenant={self.max_subscribers_per_tenant}, "
                "KVPOOL_MAX_EVENT_SUBSCRIBERS_PER_TENANT), and all of them keep up: close one of them, or raise "
                "the limit")
        if not blocked:
            raise TooManyStreamsError(
                f"kvpool-server already has {self.num_subscribers} SubscribeEvents streams open, its limit "
                f"(--max-event-subscribers={self.max_subscribers}, KVPOOL_MAX_EVENT_SUBSCRIBERS), and all of them "
                "keep up: close one, or raise the limit")
        slowest = min(blocked, key=lambda s: s.blocked_since or now)
        slowest.shed = SlowSubscriberError(
            f"SubscribeEvents ended: this subscriber did not read its stream for {now - (slowest.blocked_since or now):.1f}"
            f" s while {self._cap_reached(at_tenant_cap)} were open and another subscribed (too slow a consumer); "
            "resubscribe with from_seq to resume")
        if slowest.task is not None:
            self._shed[slowest.task] = slowest.shed
            slowest.task.cancel()

    def _cap_reached(self, at_tenant_cap: bool) -> str:
        if at_tenant_cap:
            return f"--max-event-subscribers-per-tenant={self.max_subscribers_per_tenant} of its tenant"
        return f"--max-event-subscribers={self.max_subscribers}"

    def publish(self) -> None:
        """After a mutation, under the lock (on the loop's thread, or the fast path's): close its events into a
        batch, wake subscribers."""
        if not self.log.pending:
            return
        batch = self.log.publish()
        if batch is None:
            return
        for sink in self.sinks:
            sink(batch, self.log.buffered_bytes(batch))
        published, self._published = self._published, None
        if published is not None:
            event, loop, thread = published
            if threading.get_ident() == thread:  # a call on the loop (gRPC)
                event.set()
            else:  # the fast path's thread: an asyncio.Event set from here would not wake the loop
                try:
                    loop.call_soon_threadsafe(event.set)
                except RuntimeError:  # the loop is closed: nobody waits
                    pass

    def waiter(self) -> asyncio.Event:
        """What a subscriber awaits (on the loop) for the next batch, whichever thread publishes it."""
        if self._published is None:
            self._published = (asyncio.Event(), asyncio.get_running_loop(), threading.get_ident())
        return self._published[0]

    async def follow(self, lock: threading.Lock, from_seq: int | None, epoch: int | None,
                     stopping: Callable[[], bool], tenant: str = "") -> AsyncGenerator[tuple[EventBatch, int], None]:
        """One subscriber of ``tenant``: (batch, num_dropped) pairs -- a snapshot first, unless ``from_seq`` of this
        ``epoch`` resumes within the buffer -- until ``stopping()``. Past a cap it sheds a blocked subscriber or
        refuses (TooManyStreamsError); see the module docstring."""
        self._make_room(tenant)
        task = asyncio.current_task()
        me = self._subscribers[task] = Subscriber(task, tenant)
        try:
            next_seq = from_seq if from_seq is not None else -1
            if epoch is not None and epoch != self.log.epoch:
                next_seq = -1  # from_seq numbers another start's batches
            while not stopping():
                waiter = self.waiter()
                with lock:
                    batches = self.log.since(next_seq) if next_seq >= 0 else None
                    if batches is None:
                        batches = [self.snapshot()]
                    num_dropped = self.log.num_dropped
                for batch in batches:
                    me.blocked_since = time.monotonic()  # the consumer holds it until it asks for the next
                    yield batch, num_dropped
                    me.blocked_since = None
                    next_seq = batch.seq + 1
                if next_seq < 0:
                    next_seq = self.log.next_seq
                try:
                    await asyncio.wait_for(waiter.wait(), POLL_S)
                except TimeoutError:
                    pass
        finally:
            del self._subscribers[task]
