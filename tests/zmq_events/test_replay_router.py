"""ReplayRouter's charges with real ZMQ sockets in one process: a peer that never reads holds at most its share, a
message larger than the share goes alone, one larger than the total ends the replay, and what ZMQ hands to the
connection is uncharged (replay.py)."""

from __future__ import annotations

import logging
import time

import pytest

zmq = pytest.importorskip("zmq", reason="KV events on ZMQ need pyzmq (requirements/server.txt)")
from kvpool_server.rate_limited_log import RateLimitedLog  # noqa: E402
from kvpool_server.zmq_events.replay import ReplayBudget, ReplayRouter  # noqa: E402
from kvpool_server.zmq_events.wire import END_SEQ  # noqa: E402

KiB = 1 << 10


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def serve_until(router: ReplayRouter, buffer, done, rounds: int = 2000) -> None:
    for _ in range(rounds):
        router.serve(buffer)
        if done():
            return
        time.sleep(0.001)
    raise AssertionError("not done")


def connect(ctx, endpoint: str, stuck: bool = False):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if stuck:
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


def test_charges_stay_within_the_share_and_a_reader_gets_all(ctx, tmp_path) -> None:
    budget = ReplayBudget(1 << 20)
    router = ReplayRouter(ctx, zmq, f"ipc://{tmp_path}/r", budget, 64 * KiB)
    buffer = [(b"t", 100 + i, bytes([i % 256]) * (8 * KiB)) for i in range(200)]  # 1.6 MB of payload
    buffer[50] = (b"t", 150, b"x" * (100 * KiB))  # larger than the share: sent alone
    stuck, reader = connect(ctx, router.endpoint, stuck=True), connect(ctx, router.endpoint)
    stuck.send_multipart([b"", (0).to_bytes(8, "big")])
    serve_until(router, buffer, lambda: len(router.peers) == 1 and router.charged > 0)
    for _ in range(50):
        router.serve(buffer)
        time.sleep(0.002)
    (stuck_peer,) = router.peers.values()
    assert 0 < stuck_peer.inflight_bytes <= 64 * KiB and router.charged == budget.used
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    got: list[int] = []

    def read() -> bool:
        while reader.poll(0):
            _, seq, payload = reader.recv_multipart()
            if seq == END_SEQ:
                return True
            assert payload == buffer[int.from_bytes(seq, "big") - 100][2]
            got.append(int.from_bytes(seq, "big"))
        return False

    serve_until(router, buffer, read)
    assert got == list(range(100, 300))
    router.check_invariants()
    assert stuck_peer.inflight_bytes <= 64 * KiB  # never more than its share while the other read everything
    router.close()
    stuck.close()
    reader.close()


def test_a_message_larger_than_the_total_ends_the_replay(ctx, tmp_path) -> None:
    budget = ReplayBudget(256 * KiB)
    router = ReplayRouter(ctx, zmq, f"ipc://{tmp_path}/r", budget, 64 * KiB)
    buffer = [(b"t", 1, b"a" * KiB), (b"t", 2, b"b" * (256 * KiB)), (b"t", 3, b"c")]
    reader = connect(ctx, router.endpoint)
    reader.send_multipart([b"", (0).to_bytes(8, "big")])
    seqs: list[bytes] = []

    def read() -> bool:
        while reader.poll(0):
            seqs.append(reader.recv_multipart()[1])
        return bool(seqs) and seqs[-1] == END_SEQ

    serve_until(router, buffer, read)
    assert seqs == [(1).to_bytes(8, "big"), END_SEQ] and router.num_truncated == 1
    serve_until(router, buffer, lambda: not router.peers)  # uncharged once ZMQ has handed it over
    assert budget.used == 0
    router.close()
    reader.close()


def test_rate_limited_log_counts_what_it_suppresses(caplog) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("t"), "ignored a thing:", 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="t"):
        assert log.warning("%d", 1)
        assert not any(log.warning("%d", i) for i in range(999))
        now[0] = 10.0
        assert log.warning("%d", 2)
        log.warning("%d", 3)
        log.flush()
    assert [r.getMessage() for r in caplog.records] == [
        "ignored a thing: 1", "ignored a thing: 2 (999 more suppressed in the last 10 s)",
        "ignored a thing: 1 more suppressed (1002 in all)"]
