"""The replay socket against hostile peers, on a real server process with real ZMQ DEALERs (issue 30.5): requesters
that never read hold at most their share (--kv-events-replay-peer-bytes) while a reader still gets its whole
replay, and a flood of malformed requests logs a line per interval, with the count at shutdown."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq", reason="KV events on ZMQ need pyzmq (requirements/server.txt)")
pytest.importorskip("msgpack", reason="KV events on ZMQ need msgpack (requirements/server.txt)")
import zmq  # noqa: E402

from benchmarks.hostile import rss_bytes  # noqa: E402
from kvpool_client import KVPoolClient  # noqa: E402
from tests.zmq_events.helpers import BLOCK_SIZE, event_flags, prefill  # noqa: E402

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MiB = 1 << 20
NUM_STUCK = 32
NUM_BATCHES = 300  # each ~20 KB of payload (256 blocks' token ids): a replay of ~6 MB


def dealer(ctx: zmq.Context, endpoint: str, stuck: bool = False) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if stuck:  # takes one message into its queue, then nothing: the server's queue for it fills
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock


def replay_all(sock: zmq.Socket, start: int = 0) -> list[int]:
    """The seqs of a whole replay, read to its END_SEQ."""
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    seqs = []
    while True:
        assert sock.poll(30_000), "the replay stopped"
        _, seq, _ = sock.recv_multipart()
        if seq == END_SEQ:
            return seqs
        seqs.append(int.from_bytes(seq, "big"))


def test_requesters_that_never_read_hold_their_share_and_a_reader_gets_everything(server_factory, ipc_dir) -> None:
    """32 DEALERs ask for a ~6 MB replay and never read: before, the server queued it whole for each (ZMQ's 1000
    messages a peer: ~190 MB); now each holds at most 1 MiB charged (and the payloads are the buffer's own bytes).
    A reader asking meanwhile, with a share smaller than the replay, gets every message, in order."""
    server = server_factory("--num-blocks", "1024", *event_flags(ipc_dir, "--kv-events-model", "m",
                                                                 "--kv-events-replay-peer-bytes", "1MiB"))
    with KVPoolClient(server.address, session=False) as client:
        for i in range(NUM_BATCHES):
            seq = prefill(client, [(7 * i + 13 * j) % 50_000 + 1 for j in range(256 * BLOCK_SIZE)])
            client.free(seq)
    ctx = zmq.Context()
    endpoint = f"ipc://{ipc_dir}/replay"
    try:
        reader = dealer(ctx, endpoint)
        kept = replay_all(reader)
        assert len(kept) > NUM_BATCHES and kept == list(range(kept[0], kept[0] + len(kept)))
        before = rss_bytes(server.pid)
        stuck = [dealer(ctx, endpoint, stuck=True) for _ in range(NUM_STUCK)]
        for sock in stuck:
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
        for sock in stuck:
            assert sock.poll(30_000), "a replay never started"  # a message arrived (left unread)
        again = replay_all(reader)  # served after the stuck peers' requests
        assert again[: len(kept)] == kept  # every message still kept, none skipped for the reader
        grown = rss_bytes(server.pid) - before
        assert grown < NUM_STUCK * MiB + 16 * MiB, f"the server grew {grown / MiB:.0f} MiB"
        with KVPoolClient(server.address, session=False) as client:
            client.check_invariants()
        for sock in [*stuck, reader]:
            sock.close()
    finally:
        ctx.term()


def test_a_flood_of_malformed_requests_logs_a_line_per_interval(server_factory, ipc_dir) -> None:
    """20,000 malformed requests: before, a warning each (~2.7 MB of log); now one line per 10 s with the count of
    those suppressed, the rest at shutdown. A valid request after them is answered."""
    server = server_factory(*event_flags(ipc_dir, "--kv-events-model", "m"))
    ctx = zmq.Context()
    try:
        sock = dealer(ctx, f"ipc://{ipc_dir}/replay")
        for i in range(20_000):
            sock.send_multipart([b"", b"bad", b"x", b"y", b"z"] if i % 2 else [b"not a seq"])
        replay_all(sock)  # after every malformed one (one peer's requests are read in order)
        sock.close()
    finally:
        ctx.term()
    lines = [line for line in server.log().splitlines() if "KV event replay request" in line]
    assert 1 <= len(lines) <= 3, f"{len(lines)} lines logged"
    server.stop()
    assert "(20000 in all)" in server.log()
