"""ZmqEventPublisher: the event feed's batches on vLLM's ZMQ wire (wire.py), from a thread of its own.

    feed (loop thread, under the core's lock) --offer()--> bounded queue --thread--> PUB socket, replay buffer
                                                                                    ROUTER socket (replay requests)

The feed hands each published batch to ``offer`` (``EventFeed.sinks``), which only appends it to a queue bounded in
bytes (``max_queue_bytes``, --kv-events-queue-bytes, by the log's estimate of each batch). When the thread falls
that far behind, ``offer`` drops the queue (``num_dropped`` batches) and asks the thread to restate: it takes the
log's snapshot under the core's lock -- AllBlocksCleared, then a BlockStored per cached block -- and publishes it
as one batch per topic, then goes on with the batches numbered after the snapshot, as vLLM's consumers expect of a
publisher that lost events. A gap in the log's numbering (a call whose events outgrew the log: ``KVEventLog``) is
restated the same way. Neither the append path nor the event loop ever waits for the thread or a subscriber.

Sequence numbers: one counter for the PUB socket, starting at ``unix_ms << 20`` of the start (``first_seq``), so
that a restart numbers above any earlier run (below 2**20 batches a millisecond, and a clock that does not step
back), and each start opens with AllBlocksCleared on every topic. With several topics each topic's numbers
increase with gaps (the other topics' batches).

Replay (ROUTER, vLLM's protocol): a request ``[identity, b"", start_seq (8 bytes, big-endian)]`` gets every
buffered message numbered ``start_seq`` or later as ``[identity, b"", seq, payload]``, then ``[identity, b"",
END_SEQ, b""]``. A fourth frame naming a topic (kvpool's extension) replays only that topic's messages. The buffer
keeps the last ``replay_batches`` messages and at most ``replay_bytes`` of payload: a start older than its first
message gets what is there (the first seq tells how much is missing; a restate in it begins with AllBlocksCleared).

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
from kvpool_server.zmq_events.wire import END_SEQ, TopicMap, WireEvents, batch_object

logger = logging.getLogger("kvpool_server.zmq_events")
SNDHWM = 10_000  # messages ZMQ queues for one slow subscriber before the PUB socket drops them for it
WAIT_S = 0.05  # the thread's longest wait for a batch before it looks at the replay socket again


def first_seq(now_s: float | None = None) -> int:
    """The first sequence number of a start: unix milliseconds << 20."""
    return int((time.time() if now_s is None else now_s) * 1000) << 20


class ZmqEventPublisher:
    """The PUB (and ROUTER) sockets, the bounded queue the feed fills (``offer``), and the thread that drains it
    (see the module docstring).

    Invariants (``check_invariants``): ``queued_bytes`` is the sum of the queued batches' estimates, at most
    ``max_queue_bytes``, and the queue's batches are in increasing log seq order; the replay buffer holds at most
    ``replay_batches`` messages and ``replay_bytes`` of payload (``_buffer_bytes``), in increasing seq order, all
    below ``next_seq``.
    """

    def __init__(self, feed: EventFeed, lock: threading.Lock, topics: TopicMap, *, endpoint: str, connect: bool,
                 replay_endpoint: str, layout: str, max_queue_bytes: int, replay_batches: int,
                 replay_bytes: int) -> None:
        import msgpack  # type: ignore[import-untyped]  # imported here: optional (requirements/server.txt)
        import zmq

        self._zmq = zmq
        self._packb = msgpack.Packer().pack
        self.feed, self.lock, self.layout = feed, lock, layout
        self.wire = WireEvents(topics, feed.medium)
        self.max_queue_bytes = max_queue_bytes
        self.replay_batches, self.replay_bytes = replay_batches, replay_bytes
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SNDHWM)
        self._pub.setsockopt(zmq.LINGER, 500)
        self._replay = None
        try:
            (self._pub.connect if connect else self._pub.bind)(endpoint)
            if replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if not connect else endpoint
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else ""
        self._cv = threading.Condition()
        self._queue: deque[EventBatch] = deque()
        self.queued_bytes = 0
        self._restate = True  # the first thing sent: the cache as it is (AllBlocksCleared first)
        self._stopping = False
        self._last_seq = -1  # the log's seq of the last batch sent (or restated)
        self.next_seq = first_seq()
        self._buffer: deque[tuple[bytes, int, bytes]] = deque()  # (topic, seq, payload), for replay
        self._buffer_bytes = 0
        self.num_messages = 0
        self.num_dropped = 0  # log batches dropped from the queue (the thread had fallen behind)
        self.num_restates = 0
        self._thread = threading.Thread(target=self._run, name="kvpool-zmq-events", daemon=True)

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
        buffer = list(self._buffer)  # the thread appends; a copy is enough for a check in a quiet moment
        seqs = [seq for _, seq, _ in buffer]
        if (len(buffer) > self.replay_batches or sum(len(p) for _, _, p in buffer) != self._buffer_bytes
                or self._buffer_bytes > self.replay_bytes):
            raise InvariantViolationError("the replay buffer is over its bounds or miscounted")
        if seqs != sorted(set(seqs)) or (seqs and seqs[-1] >= self.next_seq):
            raise InvariantViolationError("the replay buffer's sequence numbers are not increasing below next_seq")

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
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
        self._ctx.term()

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if not (self._queue or self._restate or self._stopping):
                        self._cv.wait(WAIT_S)
                    batches = list(self._queue)
                    self._queue.clear()
                    self.queued_bytes = 0
                    restate, self._restate = self._restate, False
                    stopping = self._stopping
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
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
            snapshot = self.feed.log.snapshot(self.feed.cache)
        self.num_restates += 1
        self._send(snapshot.events)
        self._last_seq = snapshot.seq

    def _send(self, events: Any) -> None:
        ts = time.time()
        for topic, wire_events in self.wire.translate(events).items():
            payload = self._packb(batch_object(ts, wire_events, self.layout))
            seq = self.next_seq
            self.next_seq += 1
            self._pub.send_multipart((topic.name, seq.to_bytes(8, "big"), payload), copy=False)
            self.num_messages += 1
            self._buffer.append((topic.name, seq, payload))
            self._buffer_bytes += len(payload)
            while len(self._buffer) > self.replay_batches or self._buffer_bytes > self.replay_bytes:
                self._buffer_bytes -= len(self._buffer.popleft()[2])

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) not in (3, 4) or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("ignored a KV event replay request of %d frames (expected [identity, '', seq])",
                           len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        topic = frames[3] if len(frames) == 4 else None
        for name, seq, payload in list(self._buffer):
            if seq >= start and (topic is None or name == topic):
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))
