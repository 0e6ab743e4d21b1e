"""ReplayRouter: vLLM's replay protocol on a ROUTER socket, bounded in bytes in all and per peer (docs/scale-out.md).

A request ``[identity, b"", start_seq (8 bytes, big-endian)]`` (a fourth frame: that topic only) starts a replay for
its peer: every kept message numbered ``start_seq`` or later as ``[identity, b"", seq, payload]``, then
``[identity, b"", END_SEQ, b""]``. A peer's new request replaces its replay in progress.

What the server holds for a peer that does not read is bounded:

* each replay message's payload is sent without a copy (the replay buffer's own bytes) and tracked (pyzmq's
  MessageTracker is done once ZMQ has handed it to the connection); until then it is charged, at its payload size
  plus ``MESSAGE_CHARGE``, to its peer (at most ``peer_bytes``, --kv-events-replay-peer-bytes) and to all
  (``ReplayBudget``, at most --kv-events-replay-queued-bytes);
* a message that would pass either bound is not sent yet: the peer's replay waits (its cursor is kept) and goes
  on as the peer reads. A message larger than the peer's share is sent alone (nothing else of the peer's held:
  a peer holds at most the larger of its share and one message, which the replay buffer bounds); one larger than
  the total ends the replay there (END_SEQ: the consumer sees the last seq it got). A peer that never reads keeps
  its share until it disconnects; while such peers hold the whole total, other replays wait.
* sends are NOBLOCK with ROUTER_MANDATORY: a peer whose ZMQ queue holds ``SNDHWM`` messages is skipped this round
  (END markers are copied, untracked: at most SNDHWM of them per peer), one that left is forgotten; the kernel
  holds at most ``SNDBUF`` (doubled by Linux) per connection beyond what is charged.

Each round (``serve``) reads at most ``MAX_REQUESTS_PER_ROUND`` requests and looks at most at
``MAX_ENTRIES_PER_ROUND`` buffer entries, so the publisher's thread keeps publishing whatever peers do. Inbound, a
frame over ``MAX_REQUEST_FRAME`` disconnects its peer (MAXMSGSIZE), frames past the fourth are dropped as read, and
malformed requests are counted and logged at most once per ``LOG_INTERVAL_S`` (RateLimitedLog).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.rate_limited_log import RateLimitedLog
from kvpool_server.zmq_events.wire import END_SEQ

logger = logging.getLogger("kvpool_server.zmq_events")
MESSAGE_CHARGE = 512  # bytes charged per message beyond its payload: its frames and the tracker
SNDHWM = 100  # messages ZMQ queues for one replay peer
SNDBUF = 128 << 10  # the kernel's send buffer of each replay connection
RCVHWM = 64  # requests ZMQ queues from one peer
MAX_REQUEST_FRAME = 4096  # a larger inbound frame disconnects its peer
MAX_PEERS = 1024  # peers with a replay in progress or messages charged; a new one past it gets END_SEQ at once
MAX_REQUESTS_PER_ROUND = 256
MAX_ENTRIES_PER_ROUND = 4096
DRAIN_POLL_S = 0.005  # how soon the thread looks again while a replay waits for its peer to read
LOG_INTERVAL_S = 10.0
SENT, FULL, GONE = "sent", "full", "gone"
Entry = tuple[bytes, int, bytes]  # (topic, seq, payload): the replay buffer's entries, consecutive seqs


class ReplayBudget:
    """The bytes charged to every replay peer of every ROUTER socket (one thread): ``used`` <= ``total_bytes``."""

    def __init__(self, total_bytes: int) -> None:
        self.total_bytes = total_bytes
        self.used = 0


@dataclass(eq=False)
class ReplayPeer:
    """One peer: its replay in progress (``cursor``: the next seq to send, None: none) and its messages ZMQ still
    holds (``inflight``: tracker and charge, ``inflight_bytes`` their sum)."""

    identity: bytes
    cursor: int | None = None
    topic: bytes | None = None
    inflight: deque[tuple[Any, int]] = field(default_factory=deque)
    inflight_bytes: int = 0


class ReplayRouter:
    """The ROUTER socket and its peers (see the module docstring).

    Invariants (``check_invariants``): each peer's ``inflight_bytes`` is the sum of its charges, at most
    ``peer_bytes`` unless it is one message; ``charged`` is their sum over the peers; at most ``MAX_PEERS``
    peers."""

    def __init__(self, ctx: Any, zmq: Any, endpoint: str, budget: ReplayBudget, peer_bytes: int) -> None:
        self.zmq = zmq
        self.sock = ctx.socket(zmq.ROUTER)
        for option, value in ((zmq.LINGER, 0), (zmq.ROUTER_MANDATORY, 1), (zmq.SNDHWM, SNDHWM),
                              (zmq.SNDBUF, SNDBUF), (zmq.RCVHWM, RCVHWM), (zmq.MAXMSGSIZE, MAX_REQUEST_FRAME)):
            self.sock.setsockopt(option, value)
        self.sock.copy_threshold = 0  # every copy=False send is zero-copy and tracked, whatever its size
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError:
            self.sock.close()
            raise
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.budget = budget
        self.peer_bytes = min(peer_bytes, budget.total_bytes)
        self.peers: dict[bytes, ReplayPeer] = {}
        self.charged = 0  # bytes charged to this socket's peers (their share of budget.used)
        self.num_requests = 0
        self._moved = False  # this round sent, reaped or read something
        self.num_refused = 0  # requests answered END_SEQ at once: MAX_PEERS peers already
        self.num_truncated = 0  # replays ended before a message larger than the total
        self.malformed = RateLimitedLog(
            logger, "ignored a malformed KV event replay request (expected [identity, '', seq (8 bytes)[, topic]]):",
            LOG_INTERVAL_S)

    def serve(self, buffer: Sequence[Entry]) -> float | None:
        """One round: read requests, reap what peers have taken, send what fits. Returns how soon to call again: 0
        (more work now), DRAIN_POLL_S (this round moved something: requests coming, a replay under way at its
        peer's pace), or None (nothing moved: the caller's own pace, e.g. only peers that do not read)."""
        self._moved = False
        more = self._read_requests()
        more = self._pump(buffer) or more
        if more:
            return 0.0
        return DRAIN_POLL_S if self._moved else None

    def _read_requests(self) -> bool:
        zmq = self.zmq
        for _ in range(MAX_REQUESTS_PER_ROUND):
            try:
                identity = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return False
            frames, num_frames = [], 1
            while self.sock.getsockopt(zmq.RCVMORE):  # a message arrives whole: the rest is there
                frame = self.sock.recv()
                num_frames += 1
                if len(frames) < 3:
                    frames.append(frame)
            self.num_requests += 1
            self._moved = True
            if num_frames not in (3, 4) or frames[0] != b"" or len(frames[1]) != 8:
                self.malformed.warning("%d frames", num_frames)
                continue
            self._start(identity, int.from_bytes(frames[1], "big"), frames[2] if num_frames == 4 else None)
        return True

    def _start(self, identity: bytes, start: int, topic: bytes | None) -> None:
        peer = self.peers.get(identity)
        if peer is None:
            if len(self.peers) >= MAX_PEERS:
                self.num_refused += 1
                self._send_end(identity)
                return
            peer = self.peers[identity] = ReplayPeer(identity)
        peer.cursor, peer.topic = start, topic

    def _pump(self, buffer: Sequence[Entry]) -> bool:
        """Send what fits for each peer with a replay in progress; True when some peer ran out of this round's
        work (more to send now)."""
        active = sum(p.cursor is not None for p in self.peers.values())
        quantum = max(16, MAX_ENTRIES_PER_ROUND // max(1, active))
        more = False
        for peer in list(self.peers.values()):
            self._reap(peer)
            if peer.cursor is not None:
                more = self._advance(peer, buffer, quantum) or more
            if peer.cursor is None and not peer.inflight:
                del self.peers[peer.identity]
        return more

    def _advance(self, peer: ReplayPeer, buffer: Sequence[Entry], quantum: int) -> bool:
        """Send ``peer``'s next messages (at most ``quantum`` entries looked at); True when the quantum ran out."""
        assert peer.cursor is not None
        first = buffer[0][1] if buffer else peer.cursor
        index = max(0, peer.cursor - first)
        while index < len(buffer):
            if quantum == 0:
                return True
            quantum -= 1
            topic, seq, payload = buffer[index]
            if peer.topic is None or topic == peer.topic:
                charge = len(payload) + MESSAGE_CHARGE
                if charge > self.budget.total_bytes:
                    self.num_truncated += 1
                    break  # never fits: the replay ends here
                if ((peer.inflight and peer.inflight_bytes + charge > self.peer_bytes)
                        or self.budget.used + charge > self.budget.total_bytes):
                    return False  # waits for its peer (or the others) to read
                sent = self._send(peer, seq, payload, charge)
                if sent != SENT:
                    if sent == GONE:
                        peer.cursor = None
                    return False
            peer.cursor = seq + 1
            index += 1
        if self._send_end(peer.identity) != FULL:
            peer.cursor = None
        return False

    def _routed(self, send: Any) -> str:
        """``send()`` the first frame of a message (NOBLOCK, ROUTER_MANDATORY): SENT, FULL (the peer's queue is
        full) or GONE (the peer disconnected)."""
        zmq = self.zmq
        try:
            send()
        except zmq.Again:
            return FULL
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return GONE
            raise
        return SENT

    def _send(self, peer: ReplayPeer, seq: int, payload: bytes, charge: int) -> str:
        zmq = self.zmq
        routed = self._routed(lambda: self.sock.send(peer.identity, zmq.SNDMORE | zmq.NOBLOCK))  # checked once
        if routed != SENT:
            return routed
        self.sock.send(b"", zmq.SNDMORE)
        self.sock.send(seq.to_bytes(8, "big"), zmq.SNDMORE)
        tracker = self.sock.send(payload, copy=False, track=True)
        peer.inflight.append((tracker, charge))
        peer.inflight_bytes += charge
        self.charged += charge
        self.budget.used += charge
        self._moved = True
        return SENT

    def _send_end(self, identity: bytes) -> str:
        return self._routed(lambda: self.sock.send_multipart((identity, b"", END_SEQ, b""), self.zmq.NOBLOCK))

    def _reap(self, peer: ReplayPeer) -> None:
        """Uncharge the messages ZMQ is done with (in order: one still held keeps those after it charged)."""
        while peer.inflight and peer.inflight[0][0].done:
            _, charge = peer.inflight.popleft()
            self._moved = True
            peer.inflight_bytes -= charge
            self.charged -= charge
            self.budget.used -= charge

    def close(self) -> None:
        self.malformed.flush()
        self.sock.close()

    def check_invariants(self) -> None:
        peers = list(self.peers.values())
        if len(peers) > MAX_PEERS:
            raise InvariantViolationError(f"{len(peers)} replay peers kept, more than {MAX_PEERS}")
        for peer in peers:
            charges = sum(charge for _, charge in list(peer.inflight))
            if charges != peer.inflight_bytes or (charges > self.peer_bytes and len(peer.inflight) > 1):
                raise InvariantViolationError("a replay peer's charge is miscounted or over its share")
        if sum(p.inflight_bytes for p in peers) != self.charged:
            raise InvariantViolationError("the replay socket's charge is not the sum of its peers'")
