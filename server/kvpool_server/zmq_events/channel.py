"""Channel: one ZMQ PUB socket (and its ROUTER replay socket) -- the topics it carries, its sequence numbers and its
replay buffer (publisher.py drives it from its thread; only that thread touches it).

Sequence numbers: one counter per PUB socket, as vLLM's publisher keeps one, starting at ``unix_ms << 20`` of the
start (``first_seq``), so that a restart numbers above any earlier run (below 2**20 messages a millisecond, and a
clock that does not step back). One socket carries every model name (llm-d reads the model from each topic) unless
--kv-events-socket-per-model gives each its own socket (``channel_endpoint``), whose numbers then have no gaps.

Replay (ROUTER, vLLM's protocol; replay.py, bounded in bytes per peer and in all): a request ``[identity, b"",
start_seq (8 bytes, big-endian)]`` gets every kept message numbered ``start_seq`` or later as ``[identity, b"", seq,
payload]``, then ``[identity, b"", END_SEQ, b""]``. A fourth frame naming a topic (kvpool's extension) replays only
that topic's messages. The buffer keeps the last ``replay_batches`` messages and at most ``replay_bytes`` of
payload: a start older than its first message gets what is there (the first seq tells how much is missing).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

from kvpool_server.core.errors import InvariantViolationError
from kvpool_server.zmq_events.replay import ReplayBudget, ReplayRouter

logger = logging.getLogger("kvpool_server.zmq_events")
SNDHWM = 10_000  # messages ZMQ queues for one slow subscriber before the PUB socket drops them for it


def first_seq(now_s: float | None = None) -> int:
    """The first sequence number of a start: unix milliseconds << 20."""
    return int((time.time() if now_s is None else now_s) * 1000) << 20


def channel_endpoint(endpoint: str, index: int) -> str:
    """The ``index``-th socket's endpoint: the same for 0; else tcp's port + index (port 0 stays 0: any free port)
    or ipc's path + "-index" (vLLM offsets a data-parallel rank's port the same way)."""
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + index if int(port) else 0}"
    return f"{endpoint}-{index}"


class Channel:
    """One PUB socket, its optional ROUTER replay socket, its counter and replay buffer.

    Invariants (``check_invariants``): the replay buffer holds at most ``replay_batches`` messages and
    ``replay_bytes`` of payload (``buffer_bytes`` counts them), with consecutive seqs (the replay finds a seq by
    its offset from the first), all below ``next_seq``; the replay socket's own (ReplayRouter).
    """

    def __init__(self, ctx: Any, zmq: Any, endpoint: str, connect: bool, replay_endpoint: str,
                 replay_batches: int, replay_bytes: int, replay_budget: ReplayBudget | None = None,
                 replay_peer_bytes: int = 1 << 20) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, SNDHWM)
        self.pub.setsockopt(zmq.LINGER, 500)
        self.replay: ReplayRouter | None = None
        try:
            (self.pub.connect if connect else self.pub.bind)(endpoint)
            if replay_endpoint:
                budget = replay_budget if replay_budget is not None else ReplayBudget(64 << 20)
                self.replay = ReplayRouter(ctx, zmq, replay_endpoint, budget, replay_peer_bytes)
        except zmq.ZMQError:
            self.close()
            raise
        self.endpoint = endpoint if connect else self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.replay.endpoint if self.replay is not None else ""
        self.replay_batches, self.replay_bytes = replay_batches, replay_bytes
        self.next_seq = first_seq()
        self.buffer: deque[tuple[bytes, int, bytes]] = deque()  # (topic, seq, payload)
        self.buffer_bytes = 0
        self.num_messages = 0

    def send(self, topic: bytes, payload: bytes) -> None:
        seq = self.next_seq
        self.next_seq += 1
        self.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload), copy=False)
        self.num_messages += 1
        self.buffer.append((topic, seq, payload))
        self.buffer_bytes += len(payload)
        while len(self.buffer) > self.replay_batches or self.buffer_bytes > self.replay_bytes:
            self.buffer_bytes -= len(self.buffer.popleft()[2])

    def serve_replay(self) -> float | None:
        """A round of the replay socket (ReplayRouter.serve): how soon to come back (None: nothing in progress)."""
        return self.replay.serve(self.buffer) if self.replay is not None else None

    def close(self) -> None:
        self.pub.close()
        if self.replay is not None:
            self.replay.close()

    def check_invariants(self) -> None:
        buffer = list(self.buffer)  # the thread appends; a copy is enough for a check in a quiet moment
        seqs = [seq for _, seq, _ in buffer]
        if (len(buffer) > self.replay_batches or sum(len(p) for _, _, p in buffer) != self.buffer_bytes
                or self.buffer_bytes > self.replay_bytes):
            raise InvariantViolationError("the replay buffer is over its bounds or miscounted")
        if seqs != sorted(set(seqs)) or (seqs and seqs[-1] >= self.next_seq):
            raise InvariantViolationError("the replay buffer's sequence numbers are not increasing below next_seq")
        if any(b != a + 1 for a, b in zip(seqs, seqs[1:], strict=False)):
            raise InvariantViolationError("the replay buffer's sequence numbers are not consecutive")
        if self.replay is not None:
            self.replay.check_invariants()
