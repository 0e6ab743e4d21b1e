"""ZmqEventPublisher: the event feed's batches on vLLM's ZMQ wire (wire.py), from a thread of its own.

    feed (loop thread, under the core's lock) --offer()--> bounded queue --thread--> PUB socket, replay buffer
                                                                                    ROUTER socket (replay requests)

The feed hands each published batch to ``offer`` (``EventFeed.sinks``), which only appends it to a queue bounded in
bytes (``max_queue_bytes``, --kv-events-queue-bytes, by the log's estimate of each batch). When the thread falls
that far behind, ``offer`` drops the queue (``num_dropped`` batches) and asks the thread to restate: it takes the
log's snapshot under the core's lock -- AllBlocksCleared, then a BlockStored run per chain of cached blocks -- and
publishes it as one batch per topic, then goes on with the batches numbered after the snapshot, as vLLM's
consumers expect of a publisher that lost events. A gap in the log's numbering (a call whose events outgrew the log: ``KVEventLog``) is
restated the same way. Neither the append path nor the event loop ever waits for the thread or a subscriber.

The sockets, their sequence numbers (never lower than an earlier start's) and replay buffers are ``Channel``s
(channel.py): one carrying every topic, or one per model name (--kv-events-socket-per-model). Replays are served by
the same thread in bounded rounds, and what they hold for peers is bounded in bytes per peer
(--kv-events-replay-peer-bytes) and in all (--kv-events-replay-queued-bytes, ``ReplayBudget``; replay.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.core.kv_events import EventBatch, batch_bytes
from kvpool_server.service.events import EventFeed
from kvpool_server.zmq_events.channel import Channel, channel_endpoint
from kvpool_server.zmq_events.replay import ReplayBudget
from kvpool_server.zmq_events.wire import TopicMap, WireEvents, batch_object

logger = logging.getLogger("kvpool_server.zmq_events")
WAIT_S = 0.05  # the thread's longest wait for a batch before it looks at the replay socket again (sooner while a
# replay is in progress: ReplayRouter.serve says when)


class ZmqEventPublisher:
    """The PUB (and ROUTER) sockets, the bounded queue the feed fills (``offer``), and the thread that drains it
    (see the module docstring).

    Invariants (``check_invariants``): ``queued_bytes`` is the sum of the queued batches' estimates, at most
    ``max_queue_bytes``, and the queue's batches are in increasing log seq order; each channel's own (Channel);
    every model name has exactly one channel (``channel_of``).
    """

    def __init__(self, feed: EventFeed, lock: threading.Lock, topics: TopicMap, *, endpoint: str, connect: bool,
                 replay_endpoint: str, layout: str, max_queue_bytes: int, replay_batches: int,
                 replay_bytes: int, socket_per_model: bool = False, replay_peer_bytes: int = 1 << 20,
                 replay_queued_bytes: int = 64 << 20) -> None:
        import msgpack  # type: ignore[import-untyped]  # imported here: optional (requirements/server.txt)
        import zmq

        self._packb = msgpack.Packer().pack
        self.feed, self.lock, self.layout = feed, lock, layout
        self.wire = WireEvents(topics, feed.medium)
        self.max_queue_bytes = max_queue_bytes
        self._ctx = zmq.Context()
        self.channels: list[Channel] = []
        self.channel_of: dict[str, Channel] = {}  # model name -> the channel that carries its topics
        self.replay_budget = ReplayBudget(replay_queued_bytes)  # shared by every channel's replay socket
        try:
            for i in range(len(topics.topics) if socket_per_model else 1):
                self.channels.append(Channel(self._ctx, zmq, channel_endpoint(endpoint, i), connect,
                                             channel_endpoint(replay_endpoint, i), replay_batches, replay_bytes,
                                             self.replay_budget, replay_peer_bytes))
        except zmq.ZMQError:
            self._close_sockets()
            raise
        for i, topic in enumerate(topics.topics):
            self.channel_of[topic.model] = self.channels[i if socket_per_model else 0]
        self._cv = threading.Condition()
        self._queue: deque[EventBatch] = deque()
        self.queued_bytes = 0
        self._restate = True  # the first thing sent: the cache as it is (AllBlocksCleared first)
        self._stopping = False
        self._last_seq = -1  # the log's seq of the last batch sent (or restated)
        self.num_dropped = 0  # log batches dropped from the queue (the thread had fallen behind)
        self.num_restates = 0
        self._thread = threading.Thread(target=self._run, name="kvpool-zmq-events", daemon=True)

    @property
    def num_messages(self) -> int:
        return sum(c.num_messages for c in self.channels)

    def replay_counts(self) -> dict[str, int]:
        """The replay sockets' counters, summed: requests (malformed ones too), malformed, refused, truncated."""
        routers = [c.replay for c in self.channels if c.replay is not None]
        return {"requests": sum(r.num_requests for r in routers),
                "malformed": sum(r.malformed.num_events for r in routers),
                "refused": sum(r.num_refused for r in routers),
                "truncated": sum(r.num_truncated for r in routers)}

    def endpoints(self) -> str:
        """Where it publishes (and replays), for the start line."""
        return ", ".join(c.endpoint + (f" (replay {c.replay_endpoint})" if c.replay_endpoint else "")
                         for c in self.channels)

    def start(self) -> None:
        with self.lock:
            self.feed.sinks.append(self.offer)
        self._thread.start()

    def offer(self, batch: EventBatch, size: int) -> None:
        """A published batch (the feed calls this under the core's lock): queue it, or drop the queue and ask for
        a restate when it would outgrow ``max_queue_bytes``. Never waits."""
        with self._cv:
            if self._restate:
                return  # a restate is coming, from a snapshot taken after this batch: it includes it
            if self.queued_bytes + size > self.max_queue_bytes:
                self.num_dropped += len(self._queue) + 1
                self._queue.clear()
                self.queued_bytes = 0
                self._restate = True
            else:
                self._queue.append(batch)
                self.queued_bytes += size
            self._cv.notify()

    def check_invariants(self) -> None:
        with self._cv:
            queued = list(self._queue)
            queued_bytes = self.queued_bytes
        if queued_bytes > self.max_queue_bytes or queued_bytes != sum(batch_bytes(b) for b in queued):
            raise InvariantViolationError(f"queued_bytes {queued_bytes} is not the queue's estimate within its bound")
        if any(b.seq <= a.seq for a, b in zip(queued, queued[1:], strict=False)):
            raise InvariantViolationError("the queued batches are not in increasing seq order")
        for channel in self.channels:
            channel.check_invariants()
        charged = sum(c.replay.charged for c in self.channels if c.replay is not None)
        if charged != self.replay_budget.used or charged > self.replay_budget.total_bytes:
            raise InvariantViolationError(f"replay bytes charged {charged} are not the budget's "
                                          f"{self.replay_budget.used} within {self.replay_budget.total_bytes}")
        if set(self.channel_of) != {t.model for t in self.wire.topics.topics}:
            raise InvariantViolationError("a model name without a channel, or a channel for no model name")

    def stop(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close the sockets."""
        with self.lock:
            if self.offer in self.feed.sinks:
                self.feed.sinks.remove(self.offer)
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for channel in self.channels:
            channel.close()
        self._ctx.term()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        wait_s = WAIT_S
        try:
            while True:
                with self._cv:
                    if not (self._queue or self._restate or self._stopping) and wait_s:
                        self._cv.wait(wait_s)
                    batches = list(self._queue)
                    self._queue.clear()
                    self.queued_bytes = 0
                    restate, self._restate = self._restate, False
                    stopping = self._stopping
                hints = [h for h in (channel.serve_replay() for channel in self.channels) if h is not None]
                wait_s = min(hints, default=WAIT_S)
                if restate:
                    self._send_restate()
                for batch in batches:
                    if batch.seq <= self._last_seq:
                        continue  # in the restate just sent
                    if batch.seq != self._last_seq + 1:
                        self._send_restate()  # a batch the log lost: the snapshot includes what it held
                        continue
                    self._send(batch.events)
                    self._last_seq = batch.seq
                if stopping and not batches:
                    return
        except Exception:
            logger.exception("the KV event publisher thread failed; no more KV events are published on ZMQ")

    def _send_restate(self) -> None:
        with self.lock:
            snapshot = self.feed.snapshot()
        self.num_restates += 1
        self._send(snapshot.events)
        self._last_seq = snapshot.seq

    def _send(self, events: Any) -> None:
        ts = time.time()
        for topic, wire_events in self.wire.translate(events).items():
            payload = self._packb(batch_object(ts, wire_events, self.layout))
            for name in topic.names:  # one name a pod; the same bytes under each
                self.channel_of[topic.model].send(name, payload)
