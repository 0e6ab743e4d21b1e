"""Hostile callers of the shared-memory fast path (issue 30), for benchmarks/hostile.py's phase and tests/fastpath.

    from benchmarks.hostile_fastpath import fastpath_attackers
    workers = fastpath_attackers(address, end, count)     # callables, one thread each, until time.monotonic() > end

    overflow   hand-written append records whose reply would not fit the reply area (forked children of a
               15-token parent, 2 tokens each: each takes a copy and a new block; reachable when the area is
               small for --max-batch: the soak's 64 KiB); refused, never applied twice
    pending    OpenFastPath up to --fast-path-max-channels, never connecting, CloseSession; again
    silent     connections to the fast-path socket that never send their token (and never close)
    step       hand-written step records of random shape (the header's F and A, counts, tokens, key bytes) naming
               random ids beside the channel's own sequence: refused whole, or each part answered; the own
               sequence grows at most once by what a record asked

    python benchmarks/hostile_fastpath.py --seconds 4    # a frontend's steps alone and under a silent flood

``RawChannel`` is a channel opened by hand (gRPC OpenSession + OpenFastPath, then the client's own
``FastChannel.connect``) whose records are written by hand: none of the official client's checks.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from kvpool import fastpath as fp
from kvpool.fastpath_step import read_step_reply, step_arrays
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from kvpool_client.fastpath import FastChannel
from kvpool_client.fastpath_records import write_request


class RawChannel:
    """A session and its fast-path channel, records written by hand; ``send`` returns the reply's header words."""

    def __init__(self, stub: Any, metadata: tuple = (), lease_ttl_ms: int = 60_000) -> None:
        self.stub, self.metadata = stub, metadata
        self.session_id = stub.OpenSession(pb.OpenSessionRequest(client_name="raw", lease_ttl_ms=lease_ttl_ms),
                                           metadata=metadata, timeout=10).session_id
        self.response = stub.OpenFastPath(pb.OpenFastPathRequest(session_id=self.session_id), metadata=metadata,
                                          timeout=10)
        self.channel = FastChannel.connect(self.response)

    def send(self, op: int, *, ids: Any = None, counts: Any = None, tokens: Any = None, arg0: int = 0,
             arg1: int = 0, extra: bytes = b"", timeout: float = 30.0) -> dict[str, int]:
        channel = self.channel
        ids = None if ids is None else np.asarray(ids, dtype=np.uint64)
        counts = None if counts is None else np.asarray(counts, dtype=np.uint32)
        tokens = None if tokens is None else np.asarray(tokens, dtype=np.uint32)

        def write(views: fp.Views) -> None:
            write_request(views, op, 0, channel.generation, ids=ids, counts=counts, tokens=tokens, arg0=arg0,
                          arg1=arg1, extra=extra)

        views, seq = channel._publish(write, "raw")
        channel._wait(views, seq, "raw", timeout)
        rep = views.rep.tolist()
        return {"code": rep[fp.REP_CODE], "value0": rep[fp.REP_VALUE0], "n_slots": rep[fp.REP_N_SLOTS],
                "n_children": rep[fp.REP_N_CHILDREN], "seq": rep[fp.REP_SEQ]}

    def children(self) -> list[int]:
        views = self.channel.views
        assert views is not None
        n = int(views.rep[fp.REP_N_CHILDREN])
        return views.rep_area[fp.HEADER_BYTES:fp.HEADER_BYTES + 8 * n].view(np.uint64).tolist()

    def close(self) -> None:
        self.channel.close()
        try:
            self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.session_id), metadata=self.metadata,
                                   timeout=10)
        except grpc.RpcError:
            pass


def overflow_children_needed(area_bytes: int) -> int:
    """How many children make "append 2 each" a reply over ``area_bytes`` (each child: 2 slots, a copy of the
    shared partial block and one new block)."""
    return next(n for n in range(1, 1 << 24) if fp.reply_bytes(0, 2 * n, 2 * n, n, 0) > area_bytes)


def overflowing_children(raw: RawChannel, area_bytes: int, block_size: int) -> tuple[int, list[int]]:
    """A parent one token short of a block and as many forked children as make "append 2 each" overflow the reply
    area, while the old bound (one new block a sequence) let it through. Returns (parent, children); the caller
    frees them."""
    parent = raw.send(fp.OP_REGISTER)["value0"] & ((1 << 64) - 1)
    raw.send(fp.OP_APPEND, ids=[parent], counts=[block_size - 1])
    reply = raw.send(fp.OP_FORK, arg0=parent, arg1=overflow_children_needed(area_bytes))
    assert reply["code"] == 0, reply
    return parent, raw.children()


def silent_connections(address: str, n: int) -> list[socket.socket]:
    """``n`` connections to the fast-path socket that never send their token."""
    path = "\0" + address[1:] if address.startswith("@") else address
    socks = []
    for _ in range(n):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        socks.append(sock)
    return socks


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def fastpath_attackers(address: str, end: float, count: Callable[[str, str], None]) -> list[Callable[[], None]]:
    """The four attacks as thread bodies, each counting its answers (``count(kind, what)``) until ``end``. An
    attack refused on its way (--max-sessions full, its session expired meanwhile) counts that and starts again."""
    grpc_channel = grpc.insecure_channel(address)
    stub = pb_grpc.KVPoolServiceStub(grpc_channel)
    layout = stub.DescribePool(pb.DescribePoolRequest(), timeout=10).layout

    def overflow() -> None:
        raw = RawChannel(stub)
        try:
            if overflow_children_needed(int(raw.response.area_bytes)) > raw.response.max_batch:
                count("fp-overflow", "not reachable: the reply area is too big for --max-batch children")
                time.sleep(max(0.0, end - time.monotonic()))
                return
            while time.monotonic() < end:
                try:
                    parent, children = overflowing_children(raw, int(raw.response.area_bytes), layout.block_size)
                except AssertionError:  # the fork did not fit the pool now (other attackers hold it): again
                    count("fp-overflow", "fork refused")
                    time.sleep(0.1)
                    continue
                reply = raw.send(fp.OP_APPEND, ids=children, counts=[2])
                lengths = {stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=c), timeout=10).num_tokens
                           for c in children[:8]}
                count("fp-overflow", "refused" if reply["code"] else "APPLIED")
                count("fp-overflow", "APPLIED TWICE" if max(lengths) > layout.block_size + 1 else "at most once")
                raw.send(fp.OP_FREE, ids=[parent, *children])
        finally:
            raw.close()

    def pending() -> None:
        session_id = stub.OpenSession(pb.OpenSessionRequest(client_name="pending"), timeout=10).session_id
        try:
            for _ in range(4096):
                try:
                    stub.OpenFastPath(pb.OpenFastPathRequest(session_id=session_id), timeout=10)
                    count("fp-pending", "opened")
                except grpc.RpcError as exc:
                    count("fp-pending", exc.code().name)
                    break
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=10)
        time.sleep(0.5)

    def silent() -> None:
        session_id = stub.OpenSession(pb.OpenSessionRequest(client_name="silent"), timeout=10).session_id
        address = stub.OpenFastPath(pb.OpenFastPathRequest(session_id=session_id), timeout=10).socket_address
        stub.CloseSession(pb.CloseSessionRequest(session_id=session_id), timeout=10)
        held: list[socket.socket] = []
        try:
            while time.monotonic() < end:
                held += silent_connections(address, 16)
                count("fp-silent", "connected")
                for sock in [s for s in held if closed_by_server(s)]:
                    count("fp-silent", "closed by the server")
                    held.remove(sock)
                    sock.close()
                time.sleep(0.05)
        finally:
            for sock in held:
                sock.close()

    def step() -> None:
        raw = RawChannel(stub)
        rng = np.random.default_rng()
        try:
            own = raw.send(fp.OP_REGISTER)["value0"] & ((1 << 64) - 1)
            while time.monotonic() < end:
                n = int(rng.integers(0, 5))
                ids = [int(i) for i in rng.integers(1, 1 << 62, n)]
                ids.insert(int(rng.integers(0, n + 1)), own)
                n_free, n_append = int(rng.integers(-1, len(ids) + 2)), int(rng.integers(-1, len(ids) + 2))
                n_free = min(n_free, 0) if rng.random() < 0.8 else n_free  # mostly no Free: keep the own sequence
                counts = [int(c) for c in rng.integers(0, 40, int(rng.integers(0, 2 * len(ids) + 2)))]
                tokens = [int(t) for t in rng.integers(0, 1000, int(rng.integers(0, 120)))]
                extra = rng.bytes(int(rng.integers(0, 4))) if rng.random() < 0.3 else b""
                if rng.random() < 0.5:  # a well-formed record whose parts lie: unknown ids, repeats, 0 counts
                    lies = [int(i) for i in rng.integers(1, 1 << 62, int(rng.integers(0, 3)))]
                    appended = [own, *lies] + ([own] if rng.random() < 0.2 else [])
                    counts_a = rng.integers(0 if rng.random() < 0.1 else 1, 20, len(appended)).astype(np.uint32)
                    prompts = [rng.integers(0, 1000, int(rng.integers(0, 80))).astype(np.uint32)
                               for _ in range(int(rng.integers(0, 3)))]
                    arrays = step_arrays(np.asarray(lies[:1] if rng.random() < 0.3 else [], np.uint64),
                                         np.asarray(appended, np.uint64), counts_a, None, prompts,
                                         [b""] * len(prompts))
                    ids, counts, tokens, extra, n_free, n_append = arrays
                    ids, counts, tokens = ids.tolist(), counts.tolist(), tokens.tolist()
                before = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=own), timeout=10).num_tokens
                reply = raw.send(fp.OP_STEP, ids=ids, counts=counts, tokens=tokens, arg0=n_free, arg1=n_append,
                                 extra=extra)
                views = raw.channel.views
                statuses = [] if reply["code"] else [c for c, _, _ in read_step_reply(views).statuses]
                count("fp-step", f"refused {reply['code']}" if reply["code"] else f"answered {statuses}")
                try:
                    after = stub.GetBlockTable(pb.GetBlockTableRequest(seq_id=own), timeout=10).num_tokens
                except grpc.RpcError:  # freed by the record (named in its Free): a new one
                    own = raw.send(fp.OP_REGISTER)["value0"] & ((1 << 64) - 1)
                    count("fp-step", "own sequence freed")
                    continue
                count("fp-step", "APPLIED TWICE" if after - before > max(counts, default=0) else "at most once")
        finally:
            raw.close()

    def again(kind: str, attack: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            while time.monotonic() < end:
                try:
                    attack()
                except (grpc.RpcError, OSError) as exc:
                    what = exc.code().name if isinstance(exc, grpc.RpcError) else type(exc).__name__
                    count(kind, f"interrupted: {what}")
                    time.sleep(0.1)
        return run

    return [again("fp-overflow", overflow), again("fp-pending", pending), again("fp-silent", silent),
            again("fp-step", step)]


def measure_silent_flood(seconds: float, seqs: int) -> dict:
    """A fast-path frontend's decode steps (``seqs`` sequences, one token each) alone, then while silent
    connections flood the fast-path socket (each held until the server closes it)."""
    import tempfile
    import threading

    from kvpool_client import KVPoolClient
    from tests.conftest import start_server

    server = start_server(tempfile.mkdtemp(prefix="kvpool-silent-"), "--num-blocks", "8192", "--head-dim", "8")
    result: dict = {}
    try:
        with KVPoolClient(server.address) as client:
            def run(label: str) -> None:
                ids, length, latencies = [client.register() for _ in range(seqs)], 0, []
                stop = time.monotonic() + seconds
                while time.monotonic() < stop:
                    started = time.perf_counter()
                    client.append(ids, 1)
                    latencies.append(time.perf_counter() - started)
                    length += 1
                    if length == 1000:  # stay within the pool
                        client.free(ids)
                        ids, length = [client.register() for _ in range(seqs)], 0
                client.free(ids)
                ms = np.percentile(np.array(latencies) * 1e3, [50, 99])
                result[label] = {"steps_per_s": round(len(latencies) / seconds), "p50_ms": round(ms[0], 3),
                                 "p99_ms": round(ms[1], 3)}

            run("alone")
            address = client._stub.OpenFastPath(pb.OpenFastPathRequest(session_id=client.session_id),
                                                metadata=client._metadata, timeout=10).socket_address
            flooding, opened = threading.Event(), [0]

            def flood() -> None:
                held: list[socket.socket] = []
                while not flooding.is_set():
                    if len(held) < 256:
                        held += silent_connections(address, 1)
                        opened[0] += 1
                    for sock in [s for s in held if closed_by_server(s)]:
                        held.remove(sock)
                        sock.close()
                    time.sleep(0.001)
                for sock in held:
                    sock.close()

            thread = threading.Thread(target=flood, daemon=True)
            thread.start()
            run("silent flood")
            flooding.set()
            thread.join()
            result["silent connections opened"] = opened[0]
            assert client.fast_path_open
    finally:
        server.stop()
    return result


if __name__ == "__main__":
    import argparse
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.conftest starts the server

    parser = argparse.ArgumentParser(description="a fast-path frontend's steps alone and under a flood of silent "
                                     "connections to the fast-path socket (issue 30.4)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--seqs", type=int, default=64)
    args = parser.parse_args()
    print(json.dumps(measure_silent_flood(args.seconds, args.seqs)))
