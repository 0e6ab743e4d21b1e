"""Hostile callers against every bound the server keeps (issue 20), for a while, at once; then the server's memory.

    from benchmarks.hostile import hostile_phase
    result = hostile_phase(address, server_pid, seconds=30)      (benchmarks/soak.py runs it first and last)

Each attacker is a thread of its own, hammering one bound until the time is up:

    sessions       OpenSession until --max-sessions refuses, then close them all, again
    names          OpenSession with a 1 MiB client_name (refused: 256 bytes at most)
    big-writes     8 threads of WriteKV near --max-message-bytes, a third of them malformed (--max-inflight-bytes)
    prompts        RegisterSequence with a prompt longer than --max-seq-len (refused before hashing)
    sealing        long prompts sealed and freed in a loop (the KV event log, bounded in bytes)
    subscribers    SubscribeEvents streams that never read, past --max-event-subscribers (the slow are shed)
    garbage        random bytes to every unary method (INVALID_ARGUMENT, nothing kept)
    fp-*           the fast path's attackers (benchmarks/hostile_fastpath.py): overflowing records, channels
                   never connected, silent socket connections, step records of random shape
    replay-*, idle-holders   the KV events' attackers (benchmarks/hostile_zmq.py)

The result counts each answer by status code and the server's resident memory before, at its peak and after;
the caller decides what is too much (soak.py: the server must stay up, answer Health, and end within a bound).
"""

# ruff: noqa: B023  (each lambda is called within the iteration that made it)
from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import grpc
import numpy as np

from benchmarks.hostile_fastpath import fastpath_attackers
from kvpool.v1 import kvpool_pb2 as pb
from kvpool.v1 import kvpool_pb2_grpc as pb_grpc
from benchmarks.hostile_zmq import zmq_attackers


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _code(call: Callable[[], object]) -> str:
    try:
        call()
        return "OK"
    except grpc.RpcError as exc:
        return exc.code().name  # type: ignore[no-any-return]


def hostile_phase(address: str, pid: int, seconds: float, seed: int = 0) -> dict:
    channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1),
                                                       ("grpc.max_receive_message_length", -1)])
    stub = pb_grpc.KVPoolServiceStub(channel)
    layout = stub.DescribePool(pb.DescribePoolRequest(), timeout=10).layout
    counts: dict[str, Counter] = {}
    lock = threading.Lock()
    end = time.monotonic() + seconds
    rss = {"before": rss_bytes(pid), "peak": 0}

    def count(kind: str, code: str) -> None:
        with lock:
            counts.setdefault(kind, Counter())[code] += 1

    def sessions() -> None:
        while time.monotonic() < end:
            opened = []
            for _ in range(100_000):
                try:
                    opened.append(stub.OpenSession(pb.OpenSessionRequest(client_name="flood"), timeout=10).session_id)
                    count("sessions", "OK")
                except grpc.RpcError as exc:
                    count("sessions", exc.code().name)
                    break
            for session_id in opened:  # NOT_FOUND for one whose lease ran out meanwhile
                count("sessions-closed", _code(lambda: stub.CloseSession(
                    pb.CloseSessionRequest(session_id=session_id), timeout=10)))

    def names() -> None:
        while time.monotonic() < end:
            count("names", _code(lambda: stub.OpenSession(pb.OpenSessionRequest(client_name="n" * (1 << 20)),
                                                          timeout=10)))

    def big_writes(index: int) -> None:
        max_tokens = min((4 << 20) // layout.token_bytes, 7680)  # ~4 MiB bodies: 8 of them pass --max-inflight-bytes
        seq = stub.RegisterSequence(pb.RegisterSequenceRequest(), timeout=10).seq_id
        stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], num_tokens=[max_tokens]), timeout=10)
        data = bytes(max_tokens * layout.token_bytes)
        while time.monotonic() < end:
            body = data if index % 3 else data[:-1]  # a third malformed: refused, and must not stay resident
            count("big-writes", _code(lambda: stub.WriteKV(pb.WriteKVRequest(seq_id=seq, data=body), timeout=30)))
        stub.Free(pb.FreeRequest(seq_ids=[seq]), timeout=10)

    def prompts() -> None:
        prompt = list(range(1 << 16))
        while time.monotonic() < end:
            count("prompts", _code(lambda: stub.RegisterSequence(
                pb.RegisterSequenceRequest(prompt_token_ids=prompt), timeout=10)))

    def sealing() -> None:
        rng = np.random.default_rng(seed)
        while time.monotonic() < end:
            tokens = rng.integers(0, 1 << 31, size=layout.block_size * 64).tolist()
            seq = stub.RegisterSequence(pb.RegisterSequenceRequest(prompt_token_ids=tokens[:1]), timeout=10).seq_id
            code = _code(lambda: stub.AppendToken(pb.AppendTokenRequest(
                seq_ids=[seq], num_tokens=[len(tokens)], token_ids=tokens), timeout=10))
            stub.AppendToken(pb.AppendTokenRequest(seq_ids=[seq], token_ids=[1]), timeout=10)  # seals them
            stub.Free(pb.FreeRequest(seq_ids=[seq]), timeout=10)
            count("sealing", code)

    def subscribers() -> None:
        streams = []
        while time.monotonic() < end:
            call = stub.SubscribeEvents(pb.SubscribeEventsRequest())  # never read: a stalled router
            streams.append(call)
            count("subscribers", "opened")
            time.sleep(0.1)
        for call in streams:
            count("subscribers", "ended by the server" if call.done() else "still open")
            call.cancel()

    def garbage() -> None:
        rng = random.Random(seed)
        methods = [m.name for m in pb.DESCRIPTOR.services_by_name["KVPoolService"].methods
                   if not m.client_streaming and not m.server_streaming]
        while time.monotonic() < end:
            method = channel.unary_unary(f"/kvpool.v1.KVPoolService/{rng.choice(methods)}")
            body = rng.randbytes(rng.randrange(1, 4096))
            count("garbage", _code(lambda: method(body, timeout=10)))

    def watch_rss() -> None:
        while time.monotonic() < end:
            rss["peak"] = max(rss["peak"], rss_bytes(pid))
            time.sleep(0.05)

    workers = [sessions, names, prompts, sealing, subscribers, garbage, watch_rss]
    workers += fastpath_attackers(address, end, count)
    workers += zmq_attackers(stub, pid, end, count)  # KV events: replay peers that never read, garbage, idle holders
    threads = [threading.Thread(target=fn, daemon=True) for fn in workers]
    threads += [threading.Thread(target=big_writes, args=(i,), daemon=True) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(seconds + 60)
    time.sleep(1.0)  # the server gives freed memory back (malloc_trim after the last large body)
    health = _code(lambda: stub.Stats(pb.StatsRequest(), timeout=10))
    rss["after"] = rss_bytes(pid)
    channel.close()
    return {"seconds": seconds, "answers": {k: dict(v) for k, v in sorted(counts.items())},
            "rss_mib": {k: round(v / 2**20, 1) for k, v in rss.items()}, "stats_after": health,
            "alive_threads": sum(t.is_alive() for t in threads), "pid_alive": os.path.exists(f"/proc/{pid}")}
