"""The KV events' attackers of the hostile phase (benchmarks/hostile.py; issue 30, items 5 and 14).

    workers = zmq_attackers(stub, pid, end, count)     # thread targets; hostile_phase starts them with the others

    replay-stuck    256 DEALERs that ask for a replay from 0 every second and never read (each takes one message
                    and a 4 KiB receive buffer): the server holds at most --kv-events-replay-peer-bytes for each
    replay-garbage  malformed replay requests in a flood (wrong frame counts, short seqs): logged once per 10 s
    replay-reader   a well-behaved DEALER replaying from 0 to the end marker, again and again: each complete
                    replay counted "complete", one that stalls for 30 s "stalled"
    idle-holders    SubscribeEvents streams of one tenant (the caller's), opened until refused and read (idle:
                    they keep up): refused past --max-event-subscribers-per-tenant (or --max-event-subscribers)

The replay endpoint is the server's --kv-events-replay, read from its command line (or KVPOOL_KV_EVENTS_REPLAY in
its environment); without one, only idle-holders runs. Needs pyzmq for the others.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc

from kvpool.v1 import kvpool_pb2 as pb

END_SEQ = (-1).to_bytes(8, "big", signed=True)
NUM_STUCK = 256
NUM_HOLDERS = 24


def replay_endpoint(pid: int) -> str:
    """The server's --kv-events-replay ("" when it has none)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        args = f.read().decode(errors="replace").split("\0")
    for i, arg in enumerate(args):
        if arg == "--kv-events-replay" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--kv-events-replay="):
            return arg.split("=", 1)[1]
    with open(f"/proc/{pid}/environ", "rb") as f:
        for entry in f.read().decode(errors="replace").split("\0"):
            if entry.startswith("KVPOOL_KV_EVENTS_REPLAY="):
                return entry.split("=", 1)[1]
    return ""


def zmq_attackers(stub: object, pid: int, end: float,
                  count: Callable[[str, str], None]) -> list[Callable[[], None]]:
    """The attackers' thread targets (module docstring), each running until ``end`` (time.monotonic())."""

    def idle_holders() -> None:
        streams: list[grpc.Future] = []
        readers = []
        for _ in range(NUM_HOLDERS):
            call = stub.SubscribeEvents(pb.SubscribeEventsRequest())  # type: ignore[attr-defined]
            try:
                next(iter(call))  # the snapshot: the server counts it from here
            except grpc.RpcError as exc:
                count("idle-holders", exc.code().name)
                continue
            count("idle-holders", "OK")
            streams.append(call)
            reader = threading.Thread(target=_drain, args=(call,), daemon=True)
            reader.start()
            readers.append(reader)
        time.sleep(max(0.0, end - time.monotonic()))
        for call in streams:
            call.cancel()
        for reader in readers:
            reader.join(10)

    endpoint = replay_endpoint(pid)
    if not endpoint:
        return [idle_holders]
    import zmq

    ctx = zmq.Context()
    done = threading.Barrier(3, action=ctx.term)  # the last of the three ZMQ attackers ends the context

    def dealer(stuck: bool = False) -> zmq.Socket:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if stuck:
            sock.setsockopt(zmq.RCVHWM, 1)
            sock.setsockopt(zmq.RCVBUF, 4096)
        sock.connect(endpoint)
        return sock

    def replay_stuck() -> None:
        socks = [dealer(stuck=True) for _ in range(NUM_STUCK)]
        while time.monotonic() < end:
            for sock in socks:
                try:
                    sock.send_multipart([b"", bytes(8)], zmq.NOBLOCK)
                    count("replay-stuck", "asked")
                except zmq.Again:
                    count("replay-stuck", "own queue full")
            time.sleep(1.0)
        for sock in socks:
            sock.close()
        done.wait()

    def replay_garbage() -> None:
        sock = dealer()
        shapes = [[b"not a seq"], [b"", b"short"], [b"", bytes(8), b"t", b"extra", b"frames"], [b"x", bytes(8)]]
        i = 0
        while time.monotonic() < end:
            try:
                sock.send_multipart(shapes[i % len(shapes)], zmq.NOBLOCK)
                count("replay-garbage", "sent")
            except zmq.Again:
                time.sleep(0.001)
            i += 1
            while sock.poll(0):
                sock.recv_multipart()  # nothing is answered to garbage; read whatever comes anyway
        sock.close()
        done.wait()

    def replay_reader() -> None:
        sock = dealer()
        while time.monotonic() < end:
            sock.send_multipart([b"", bytes(8)])
            while True:
                if not sock.poll(30_000):
                    count("replay-reader", "stalled")
                    break
                if sock.recv_multipart()[1] == END_SEQ:
                    count("replay-reader", "complete")
                    break
        sock.close()
        done.wait()

    return [idle_holders, replay_stuck, replay_garbage, replay_reader]


def _drain(call: grpc.Future) -> None:
    try:
        for _ in call:  # type: ignore[attr-defined]
            pass
    except grpc.RpcError:
        pass


def measure(seconds: float, num_stuck: int) -> dict:
    """Messages/s reaching a ZMQ subscriber while a client seals blocks, without and then with ``num_stuck``
    DEALERs asking for replays (every second) and never reading; the server's RSS growth during each."""
    import random
    import sys
    import tempfile
    from pathlib import Path

    import zmq

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.hostile import rss_bytes
    from kvpool_client import KVPoolClient
    from tests.conftest import start_server

    work = Path(tempfile.mkdtemp(prefix="kvz-", dir="/tmp"))
    server = start_server(work, "--num-blocks", "4096", "--kv-events-publish", f"ipc://{work}/pub",
                          "--kv-events-replay", f"ipc://{work}/replay", "--kv-events-model", "m")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{work}/pub")
    rng = random.Random(0)
    result = {}
    try:
        with KVPoolClient(server.address, session=False) as client:
            for phase, stuck_count in (("alone", 0), (f"with {num_stuck} stuck replay peers", num_stuck)):
                stuck = []
                for _ in range(stuck_count):
                    sock = ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.setsockopt(zmq.RCVHWM, 1)
                    sock.setsockopt(zmq.RCVBUF, 4096)
                    sock.connect(f"ipc://{work}/replay")
                    stuck.append(sock)
                rss_before, received, asked = rss_bytes(server.pid), 0, 0.0
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    if stuck and time.monotonic() - asked >= 1.0:
                        for sock in stuck:
                            sock.send_multipart([b"", bytes(8)], zmq.NOBLOCK)
                        asked = time.monotonic()
                    prompt = [rng.randrange(1 << 30) for _ in range(16 * 16)]
                    seq, cached = client.register_prompt(prompt)
                    client.append(seq, len(prompt) - cached, token_ids=prompt[cached:])
                    client.append(seq, 1, token_ids=[1])
                    client.free(seq)
                    while sub.poll(0):
                        sub.recv_multipart()
                        received += 1
                result[phase] = {"messages_per_s": round(received / seconds),
                                 "rss_growth_mib": round((rss_bytes(server.pid) - rss_before) / 2**20, 1)}
                for sock in stuck:
                    sock.close()
    finally:
        sub.close()
        ctx.term()
        server.stop()
    return result


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="publisher throughput with replay peers that never read")
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--stuck", type=int, default=256)
    args = parser.parse_args()
    print(json.dumps(measure(args.seconds, args.stuck)))
